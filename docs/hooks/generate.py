"""MkDocs hooks: the pages generated at build time.

- Reference > Console scripts: one page per console script of setup.py, listing its flags
  (type, default, help) as the script itself defines them (flags_of.py runs each entry point up
  to its flag parsing). Add a flag or a script and the page follows, with no hand edit.
- Results: each `<!-- results: NAME [columns=KEY] -->` line of a page is replaced by the table
  of the runs in benchmarks/results/NAME.jsonl; a results file no page shows, or a marker
  without its file, fails the build.
"""
import ast
import concurrent.futures
import json
import os
import re
import subprocess
import sys

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
CLI_DIR = "reference/cli"
_MARKER = re.compile(r"^<!-- results: (\S+)((?: \w+=\S+)*) -->$", re.M)
_shown = set()


# ---- console scripts ---------------------------------------------------------------------------
def console_scripts():
    """[(name, "module:function")] from setup.py's entry_points, in its order."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "console_scripts":
                    return [tuple(s.strip() for s in item.split("=", 1))
                            for item in ast.literal_eval(value)]
    raise PluginError("setup.py: no console_scripts entry points found")


def script_flags(name, entry):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "flags_of.py"),
                           entry, name], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if done.returncode:
        raise PluginError(f"flags of {name} ({entry}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cell(value):
    text = "" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def flags_page(info, guide):
    lines = [f"# `{info['prog']}`", "",
             "Generated at build time from the script's own flag definitions: "
             "`" + info["prog"] + " --help` prints the same.", ""]
    if guide:
        lines += [f"Guide: [{guide}](../../{guide})", ""]
    summary = info.get("summary", "").strip()
    if summary:
        lines += ["```text", summary, "```", ""]
    for section in info["sections"]:
        lines += [f"## {section['title']}", "", "| flag | type | default | help |",
                  "| --- | --- | --- | --- |"]
        for f in section["flags"]:
            default = "" if f["default"] in (None, "") else f"`{_cell(f['default'])}`"
            lines.append(f"| `--{_cell(f['name'])}` | {_cell(f['type'])} | {default} | {_cell(f['help'])} |")
        lines.append("")
    return "\n".join(lines)


def _guides():
    sys.path.insert(0, ROOT)
    from tfbig.commands.cli import GUIDES

    return GUIDES


def on_config(config):
    """Console scripts' pages go into the nav under the placeholder entry."""
    pages = [f"{CLI_DIR}/index.md"] + [f"{CLI_DIR}/{name}.md" for name, _ in console_scripts()]

    def expand(items):
        for i, item in enumerate(items):
            if isinstance(item, dict):
                (title, value), = item.items()
                if value == f"{CLI_DIR}/index.md":
                    items[i] = {title: pages}
                elif isinstance(value, list):
                    expand(value)
    expand(config["nav"])
    return config


def on_files(files, config):
    scripts = console_scripts()
    guides = _guides()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        infos = list(pool.map(lambda s: script_flags(*s), scripts))
    index = ["# Console scripts", "",
             "Every command `pip install -e .` puts on the path, with the flags it defines "
             "(generated from the scripts at build time).", "",
             "| command | what it does | flags | guide |", "| --- | --- | --- | --- |"]
    for (name, entry), info in zip(scripts, infos):
        guide = guides.get(name)
        files.append(File.generated(config, f"{CLI_DIR}/{name}.md", content=flags_page(info, guide)))
        first = next((l for l in info.get("summary", "").splitlines() if l.strip()), "")
        count = sum(len(s["flags"]) for s in info["sections"])
        link = f"[{guide}](../../{guide})" if guide else ""
        index.append(f"| [`{name}`]({name}.md) | {_cell(first)} | {count} | {link} |")
    files.append(File.generated(config, f"{CLI_DIR}/index.md", content="\n".join(index) + "\n"))
    return files


# ---- results -------------------------------------------------------------------------------------
def load_results(name):
    path = os.path.join(RESULTS_DIR, f"{name}.jsonl")
    if not os.path.exists(path):
        raise PluginError(f"results page: no results file benchmarks/results/{name}.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _flat(value, prefix=""):
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): value}


def _show(value):
    if isinstance(value, list):
        return ", ".join(_show(v) for v in value)
    if isinstance(value, float):
        return json.dumps(value)
    return str(value)


def _is_table(value):
    return isinstance(value, list) and value and all(isinstance(v, dict) for v in value)


def _sub_table(rows):
    keys = list(dict.fromkeys(k for row in rows for k in _flat(row)))
    lines = ["| " + " | ".join(_cell(k) for k in keys) + " |", "|" + " --- |" * len(keys)]
    for row in rows:
        flat = _flat(row)
        lines.append("| " + " | ".join(_cell(_show(flat.get(k, ""))) for k in keys) + " |")
    return lines


def _date(run):
    return run.get("date") or "not stated"


def _where(run):
    parts = [run.get("cpu") or run.get("machine") or "machine not stated"]
    parts.append(f"load {_show(run['load'])}" if run.get("load") not in (None, "") else "load not stated")
    return "; ".join(parts)


def _source(run):
    if run.get("recorded_from"):
        return f"transcribed from {run['recorded_from']}"
    return f"`--record`, commit {run.get('git_commit') or '?'}"


def runs_table(name, options):
    runs = load_results(name)
    if options.get("columns"):
        key = options["columns"]
        rows = list(dict.fromkeys(k for r in runs for k in _flat(r["result"]) if k != key))
        lines = ["| | " + " | ".join(_cell(_show(r["result"].get(key, "?"))) for r in runs) + " |",
                 "| --- |" + " --- |" * len(runs)]
        for row in rows:
            lines.append(f"| {_cell(row)} | " + " | ".join(
                _cell(_show(_flat(r["result"]).get(row, ""))) for r in runs) + " |")
        lines += ["", "| run | date | machine, load | command | source |", "| --- | --- | --- | --- | --- |"]
        for r in runs:
            lines.append(f"| {_cell(_show(r['result'].get(key, '?')))} | {_cell(_date(r))} | "
                         f"{_cell(_where(r))} | `{_cell(r.get('command'))}` | {_cell(_source(r))} |")
        return "\n".join(lines)
    lines = ["| date | machine, load | command | figures | source |", "| --- | --- | --- | --- | --- |"]
    tables = []
    for r in runs:
        flat = _flat(r["result"])
        figures = "<br>".join(f"{_cell(k)}: {_cell(_show(v))}" for k, v in flat.items()
                              if k != "benchmark" and not _is_table(v))
        lines.append(f"| {_cell(_date(r))} | {_cell(_where(r))} | `{_cell(r.get('command'))}` | "
                     f"{figures} | {_cell(_source(r))} |")
        for k, v in flat.items():
            if _is_table(v):
                tables += ["", f"`{_cell(r.get('command'))}`, {_cell(_date(r))}, {k}:", ""] + _sub_table(v)
    return "\n".join(lines + tables)


# ---- record formats --------------------------------------------------------------------------
def record_features_table():
    """Feature, dtype and length of each record format, from tfbig.data.formats.FORMATS."""
    sys.path.insert(0, ROOT)
    from tfbig.data.formats import FORMATS

    seq, predictions = 100003, 1009  # sentinels: lengths become "T", "T + 1", "P"
    names = {seq: "T", seq + 1: "T + 1", predictions: "P"}
    lines = ["| format | feature | dtype | length |", "| --- | --- | --- | --- |"]
    for name, fmt in FORMATS.items():
        try:
            features = fmt.features(seq, max_predictions_per_seq=predictions)
        except TypeError:
            features = fmt.features(seq)
        for feature, (dtype, length) in features.items():
            lines.append(f"| `{name}` | `{feature}` | {dtype} | {names.get(length, length)} |")
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files):
    markdown = markdown.replace("<!-- generated: record-features -->", record_features_table())

    def replace(match):
        options = dict(o.split("=", 1) for o in match.group(2).split())
        _shown.add(match.group(1))
        return runs_table(match.group(1), options)
    return _MARKER.sub(replace, markdown)


def on_post_build(config):
    recorded = {f[:-len(".jsonl")] for f in os.listdir(RESULTS_DIR) if f.endswith(".jsonl")}
    missing = sorted(recorded - _shown)
    _shown.clear()
    if missing:
        raise PluginError(f"benchmarks/results: {missing} recorded but shown on no page; add "
                          "`<!-- results: NAME -->` to docs/results.md")
