"""The docs site (mkdocs.yml, docs/): it builds with --strict, its flag reference is exactly what
each console script defines, its Results come from benchmarks/results, and the shell blocks of
Get started and the guides run (or say what they need: a cluster, a GPU, a download)."""
import bz2
import html
import importlib.util
import json
import os
import random
import re
import resource
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
BIN = os.path.dirname(sys.executable)
sys.path.insert(0, os.path.join(DOCS, "hooks"))
import generate  # noqa: E402  (docs/hooks/generate.py: what the build generates)

THE_THREE_COMMANDS = """\
./install.sh                        # install: .venv with the pinned set, tfbig, Horovod (built once, cached)
.venv/bin/tfbig-train               # main job: prepare Shakespeare, train a small GPT on the CPU, sample
.venv/bin/pytest -m "not slow" -n 2 # tests
"""
MARKERS = {"test: run", "test: slow", "test: ci", "needs: cluster", "needs: gpu", "needs: download"}
GUIDE_PAGES = ["get-started.md"] + sorted(
    os.path.join("guides", f) for f in os.listdir(os.path.join(DOCS, "guides")) if f.endswith(".md"))


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
            "NO_MKDOCS_2_WARNING": "1", "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}


@pytest.fixture(scope="session")
def site(tmp_path_factory):
    """`mkdocs build --strict` once: (site directory, wall seconds, CPU seconds)."""
    out = tmp_path_factory.mktemp("site")
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    done = subprocess.run([os.path.join(BIN, "mkdocs"), "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    wall, after = time.monotonic() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, wall, cpu


def _text(path):
    """The visible text of a built page's article."""
    page = open(path).read()
    article = page[page.index("<article"):page.index("</article>")]
    article = re.sub(r"<(script|style)\b.*?</\1>", " ", article, flags=re.S)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", article)))


def test_the_site_builds_strict_within_a_minute_of_cpu(site):
    out, wall, cpu = site
    print(f"mkdocs build --strict: {wall:.1f} s wall, {cpu:.1f} CPU-s, load {os.getloadavg()[0]:.1f}")
    assert cpu < 60, f"the docs build took {cpu:.0f} CPU-seconds ({wall:.0f} s wall)"
    for page in ("index.html", "get-started/index.html", "guides/scale-out/index.html",
                 "reference/cli/tfbig-train/index.html", "reference/python-api/index.html",
                 "results/index.html", "design/architecture/index.html"):
        assert os.path.exists(out / page), page


def test_the_readme_fits_two_screens_and_keeps_the_three_commands_ci_runs():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert len(readme.splitlines()) <= 150
    assert readme.startswith("# tfbig\n\n```bash\n" + THE_THREE_COMMANDS + "```\n")
    ci = open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
    assert "./install.sh" in ci and '.venv/bin/pytest -m "not slow" -n 2' in ci


# ---- the flag reference ------------------------------------------------------------------------
def _help(entry, prog, *args):
    code = (f"import sys; sys.argv = [{prog!r}, *{list(args)!r}, '--help']; "
            f"from {entry.split(':')[0]} import {entry.split(':')[1]} as run; run()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _flags_in_help(text, prefix=""):
    """Flag names a --help text lists: tfbig.commands.cli's, absl's own list, or argparse's (absl's own
    flags, under an `absl.flags:` heading, are not the script's)."""
    text = re.sub(r"^absl\.[\w.]+:\n(?:[ \t].*\n?)*", "", text, flags=re.M)
    names = re.findall(r"^[ \t]+--(?:\[no\])?(\w+)(?:[=:]|\s|$)", text, flags=re.M)
    if "positional arguments:" in text:
        block = text.split("positional arguments:")[1].split("\n\n")[0]
        names += [n for n in re.findall(r"^  (\w+)\b", block, flags=re.M)]
    return {prefix + n for n in names if n != "help"}


def _subcommands(text):
    match = re.search(r"^\s+\{([\w,]+)\}", text, flags=re.M)
    return match.group(1).split(",") if match else []


@pytest.mark.parametrize("prog,entry", generate.console_scripts())
def test_each_reference_page_lists_exactly_the_flags_the_script_defines(site, prog, entry):
    text = _help(entry, prog)
    expected = _flags_in_help(text)
    for sub in _subcommands(text):
        expected |= _flags_in_help(_help(entry, prog, sub), prefix=f"{sub} ")
    page = open(site[0] / "reference" / "cli" / prog / "index.html").read()
    rows = re.findall(r"<tr>\s*<td><code>--([^<]+)</code></td>", page)
    assert set(rows) == expected and len(rows) == len(expected)
    # --help ends with the path of the script's guide, and that guide is a page of the site
    last = text.strip().splitlines()[-1]
    guide = re.fullmatch(r"Guide: docs/(guides/[\w-]+\.md)", last)
    assert guide, f"{prog} --help ends with {last!r}"
    assert os.path.exists(site[0] / guide.group(1)[:-3] / "index.html")


def test_a_new_flag_reaches_its_reference_page_with_no_hand_edit(tmp_path):
    (tmp_path / "fake_cli.py").write_text(
        '"""tfbig-fake: a console script with one flag more than it had."""\n'
        "from absl import flags\n"
        "from tfbig import cli\n\n\n"
        "def run():\n"
        '    flags.DEFINE_integer("brand_new_steps", 7, "A flag added today.")\n'
        '    cli.run_app("tfbig-fake", print, __doc__, [("fake", cli.own_flags())])\n')
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(tmp_path), old])
    try:
        info = generate.script_flags("tfbig-fake", "fake_cli:run")
    finally:
        os.environ["PYTHONPATH"] = old
    page = generate.flags_page(info, None)
    assert "| `--brand_new_steps` | int | `7` | A flag added today. |" in page


# ---- results -----------------------------------------------------------------------------------
def _numbers(text):
    return {float(n) for n in re.findall(r"(?<![\w.])\d+(?:\.\d+)?", text)}


def test_every_figure_on_the_results_page_comes_from_a_results_file(site):
    recorded = ""
    for name in sorted(os.listdir(generate.RESULTS_DIR)):
        if name.endswith(".jsonl"):
            with open(os.path.join(generate.RESULTS_DIR, name)) as f:
                for line in f:
                    entry = json.loads(line)
                    assert {"benchmark", "date", "command", "result"} <= set(entry), (name, line)
                    assert entry.get("cpu") or entry.get("machine") or entry.get("recorded_from")
                    recorded += line
    page = _text(site[0] / "results" / "index.html")
    unrecorded = _numbers(page) - _numbers(recorded)
    assert not unrecorded, f"figures on the Results page found in no results file: {sorted(unrecorded)}"
    assert "91.6" in page and "63.2" in page  # the ALBERT table is there, from albert_qa.jsonl


def test_record_appends_the_result_with_machine_date_load_commit_and_command(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/prep.py", "--record", "--repeats=1"])
    spec = importlib.util.spec_from_file_location("_record", os.path.join(ROOT, "benchmarks", "_record.py"))
    record = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(record)
    assert record.RECORD and sys.argv == ["benchmarks/prep.py", "--repeats=1"]  # the parser never sees it
    record.record({"benchmark": "prep", "ratio": 0.8}, results_dir=str(tmp_path))
    record.record({"benchmark": "prep", "ratio": 0.9}, results_dir=str(tmp_path))
    lines = [json.loads(l) for l in (tmp_path / "prep.jsonl").read_text().splitlines()]
    assert [l["result"]["ratio"] for l in lines] == [0.8, 0.9]
    assert lines[0]["command"] == "python benchmarks/prep.py --repeats=1 --record"
    assert lines[0]["cpu"] and len(lines[0]["load"]) == 3 and re.match(r"\d{4}-\d\d-\d\d ", lines[0]["date"])


# ---- shell blocks of Get started and the guides --------------------------------------------------
def shell_blocks(page):
    """[(marker, options, code)] of each fenced bash/sh block of a docs page."""
    text = open(os.path.join(DOCS, page)).read()
    found = []
    for match in re.finditer(r"(?:<!-- ([^>]*?) -->\n)?```(?:bash|sh|shell|console)\n(.*?)```", text, flags=re.S):
        head = (match.group(1) or "").split()
        marker = " ".join(head[:2])
        options = dict(o.split("=", 1) for o in head[2:] if "=" in o)
        found.append((marker, options, match.group(2)))
    return found


@pytest.mark.parametrize("page", GUIDE_PAGES)
def test_every_shell_block_is_run_by_a_test_or_says_what_it_needs(page):
    blocks = shell_blocks(page)
    for marker, options, code in blocks:
        assert marker in MARKERS, f"{page}: a shell block without a marker:\n{code}"
        assert set(options) <= {"fixture"} and options.get("fixture", "text") in FIXTURES, (page, options)
    ci = [code for marker, _, code in blocks if marker == "test: ci"]
    assert ci in ([], [THE_THREE_COMMANDS])  # the README's three commands, which .ci/run runs


def _commands(code):
    """(script, [flags]) of each tfbig-* command in a shell block (continuations joined; a
    command ends at `--`, `|`, `&&`, `;` or the next command it launches)."""
    for line in code.replace("\\\n", " ").splitlines():
        prog, used = None, []
        for token in line.split(" #")[0].split():
            name = os.path.basename(token)
            if name.startswith("tfbig-"):
                if prog:
                    yield prog, used
                prog, used = name, []
            elif token in ("--", "|", "&&", ";"):
                if prog:
                    yield prog, used
                prog, used = None, []
            elif prog and re.match(r"--\w", token):
                used.append(re.match(r"--(\w+)", token).group(1))
        if prog:
            yield prog, used


def test_every_flag_in_the_docs_exists_also_where_no_test_runs_it(site):
    """Blocks marked needs: cluster/gpu/download are not run; their flags are still checked
    against the generated reference (what each script defines)."""
    defined = {}
    for prog, _ in generate.console_scripts():
        page = open(site[0] / "reference" / "cli" / prog / "index.html").read()
        defined[prog] = {n.split()[-1] for n in re.findall(r"<tr>\s*<td><code>--([^<]+)</code></td>", page)}
    pages = GUIDE_PAGES + ["index.md", os.path.join("..", "README.md")]
    unknown, checked = [], 0
    for page in pages:
        for _, _, code in shell_blocks(page):
            for prog, used in _commands(code):
                checked += len(used)
                if prog in defined:
                    unknown += [f"{page}: {prog} --{f}" for f in used if f not in defined[prog]
                            and not (f.startswith("no") and f[2:] in defined[prog])
                            and f not in ("help", "flagfile")]
    assert not unknown, unknown
    assert checked > 200  # the parser found the commands


def _fixture_text(directory):
    rng = random.Random(0)
    words = ("the a river stone light night green house open field quiet letter morning garden "
             "north window bread winter answer travel silver market table dream").split()
    os.makedirs(os.path.join(directory, "my_corpus"), exist_ok=True)
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(30, 80))) + "." for _ in range(150)]
    for i, doc in enumerate(docs):
        with open(os.path.join(directory, "my_corpus", f"doc{i:03d}.txt"), "w") as f:
            f.write(doc + "\n")
    with open(os.path.join(directory, "lines.txt"), "w") as f:
        f.write("\n".join(docs) + "\n")
    return docs


def _fixture_pile(directory):
    import zstandard

    docs = _fixture_text(directory)
    groups = ["Pile-CC", "Github", "Wikipedia (en)"]
    os.makedirs(os.path.join(directory, "pile", "train"), exist_ok=True)
    for part in range(2):
        lines = [json.dumps({"text": doc, "meta": {"pile_set_name": groups[i % 3]}})
                 for i, doc in enumerate(docs) if i % 2 == part]
        with open(os.path.join(directory, "pile", "train", f"{part:02d}.jsonl.zst"), "wb") as f:
            f.write(zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode()))


def _fixture_wiki(directory):
    from xml.sax.saxutils import escape

    docs = _fixture_text(directory)
    os.makedirs(os.path.join(directory, "dumps"), exist_ok=True)
    for part in range(1, 4):  # a dump comes in parts, each one piece
        pages = "".join(f"<page><title>Page {i}</title><ns>0</ns><id>{i}</id><revision><id>{i}</id>"
                        f'<text xml:space="preserve">{escape("[[Link]] " + doc)}</text></revision></page>'
                        for i, doc in enumerate(docs) if i % 3 == part - 1)
        xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/" version="0.11" xml:lang="en">'
               f"<siteinfo><sitename>Wikipedia</sitename></siteinfo>{pages}</mediawiki>\n")
        with open(os.path.join(directory, "dumps", f"enwiki-20240601-pages-articles{part}.xml.bz2"), "wb") as f:
            f.write(bz2.compress(xml.encode()))


FIXTURES = {"text": _fixture_text, "pile": _fixture_pile, "wiki": _fixture_wiki}


def run_blocks(page, markers, directory, timeout):
    """Run the page's blocks with these markers in order, in `directory` (a user's shell: the
    environment's bin first on PATH, this tree's code)."""
    ran = 0
    for marker, options, code in shell_blocks(page):
        if marker not in markers:
            continue
        if "fixture" in options:
            FIXTURES[options["fixture"]](str(directory))
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=directory, env=_env(),
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{page}:\n{code}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        ran += 1
    return ran


@pytest.mark.parametrize("page", [  # prepare-data's blocks prepare a corpus (~35 s): slow
    pytest.param(p, marks=[pytest.mark.slow] if p.endswith("prepare-data.md") else [])
    for p in GUIDE_PAGES if any(m == "test: run" for m, _, _ in shell_blocks(p))])
def test_the_quick_shell_blocks_of_the_guides_run(page, tmp_path):
    assert run_blocks(page, {"test: run"}, tmp_path, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in GUIDE_PAGES if any(m == "test: slow" for m, _, _ in shell_blocks(p))])
def test_the_long_shell_blocks_of_the_guides_run(page, tmp_path):
    assert run_blocks(page, {"test: run", "test: slow"}, tmp_path, timeout=1200)


@pytest.mark.slow
def test_a_newcomer_sees_the_navigation_and_code_blocks_in_a_real_browser(tmp_path):
    """docs/check_site.py: the site built, served on 127.0.0.1, home page and a guide opened in
    headless Chromium (Debian: apt-get install chromium); screenshots land in tmp_path."""
    import shutil

    assert shutil.which("chromium") or shutil.which("chromium-browser"), "apt-get install chromium"
    done = subprocess.run([sys.executable, os.path.join(DOCS, "check_site.py"), "--site", str(tmp_path / "site"),
                           "--out", str(tmp_path)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert (tmp_path / "home.png").stat().st_size > 10000 and (tmp_path / "guide.png").stat().st_size > 10000
