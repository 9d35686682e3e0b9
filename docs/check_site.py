"""A newcomer's path through the built site, in a real browser (headless Chromium).

    python docs/check_site.py [--site=site] [--out=/tmp/tfbig-site-check]

Builds the site (`mkdocs build --strict`) unless --site holds one already (--no_build), serves it
on 127.0.0.1, and opens the home page and one guide in headless Chromium (Debian's `chromium`
package: `apt-get install chromium`). From the DOM Chromium renders (`--dump-dom`, after the
page's scripts ran) it checks the navigation (Get started, Guides, Reference, Results, Design
and the guide's own entries) and that code blocks render (highlighted, with Material's copy
button). Screenshots of both pages go to --out for a person to look at. Exits 1 naming what is
missing. tests/test_docs.py runs it (marked slow) where Chromium is installed.
"""
import argparse
import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = {
    "home": ("", ["Get started", "Guides", "Reference", "Results", "Design", "Scale out"]),
    "guide": ("guides/scale-out/", ["Prepare data", "Train a GPT", "Console scripts",
                                    "The rank grid", "horovodrun"]),
}


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def browse(binary, url, out_dir, name):
    """(DOM after scripts ran, screenshot path) of `url`."""
    common = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
              "--virtual-time-budget=3000"]
    dom = subprocess.run(common + ["--dump-dom", url], capture_output=True, text=True, timeout=120)
    shot = os.path.join(out_dir, f"{name}.png")
    subprocess.run(common + ["--window-size=1280,1000", f"--screenshot={shot}", url],
                   capture_output=True, timeout=120)
    return dom.stdout, shot


def problems(dom, expected):
    found = []
    nav = re.findall(r'<nav class="md-nav[^"]*"[^>]*>.*?</nav>', dom, flags=re.S)
    nav_text = re.sub(r"<[^>]+>", " ", " ".join(nav))
    for label in expected:
        if label not in nav_text and label not in dom:
            found.append(f"missing {label!r}")
    if not nav:
        found.append("no navigation rendered")
    blocks = re.findall(r'<div class="highlight"[^>]*>\s*<pre', dom)
    if not blocks:
        found.append("no code block")
    elif '<span class="' not in dom.split('<div class="highlight"', 1)[1][:2000]:
        found.append("code blocks are not highlighted")
    buttons = dom.count('class="md-code__button"')  # Material's copy button, added by its JavaScript
    if buttons < len(blocks):
        found.append(f"{buttons} copy buttons for {len(blocks)} code blocks (the page's scripts did not run)")
    return found, len(blocks)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--site", default=os.path.join(ROOT, "site"))
    parser.add_argument("--out", default="/tmp/tfbig-site-check")
    parser.add_argument("--no_build", action="store_true")
    args = parser.parse_args(argv)
    binary = chromium()
    if binary is None:
        sys.exit("check_site: no chromium on PATH (Debian: apt-get install chromium)")
    if not args.no_build:
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "mkdocs"), "build", "--strict",
                        "--site-dir", args.site], cwd=ROOT, check=True)
    os.makedirs(args.out, exist_ok=True)
    handler = functools.partial(_QuietHandler, directory=args.site)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    failed = False
    try:
        for name, (path, expected) in PAGES.items():
            url = f"http://127.0.0.1:{server.server_port}/{path}"
            dom, shot = browse(binary, url, args.out, name)
            found, blocks = problems(dom, expected)
            print(f"{name} {url}: {blocks} code blocks, screenshot {shot}"
                  + (f"; PROBLEMS: {', '.join(found)}" if found else "; navigation and code blocks render"))
            failed |= bool(found)
    finally:
        server.shutdown()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
