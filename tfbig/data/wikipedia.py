"""Wikipedia dumps (`*-pages-articles*.xml[.bz2]`): articles streamed out of the XML, their
wikitext turned into the prose a reader sees, one article per document.

Kept: the article's prose, link text (`[[England|English]]` -> "English"), external link
labels, section headings (as their own lines), list items, bold/italic text, entities
decoded. Dropped: templates (infoboxes, citation-needed marks: their rendering needs the
wiki's template code), references, tables, galleries, math, comments, and file, image,
category and interlanguage links. Pages outside the article namespace (talk, user, file,
category...) and redirects are skipped and counted (`skipped["wikipedia:non-article"]`,
`skipped["wikipedia:redirect"]`); the counts land in the manifest.

The parser is `mwparserfromhell` (maintained; pure wikitext, no wiki database needed).

Example:
    with compression.open_stream("enwiki-20240601-pages-articles1.xml.bz2") as xml:
        for text in articles(xml, "enwiki...bz2", Counter()):
            ...
"""

import re
import xml.etree.ElementTree as ElementTree
from collections import Counter
from collections.abc import Iterator
from typing import BinaryIO

ARTICLE_NAMESPACE = "0"
DROPPED_TAGS = {"ref", "references", "table", "gallery", "math", "chem", "timeline", "imagemap", "score",
                "graph", "mapframe", "templatedata", "noinclude", "includeonly"}
# Link prefixes a reader does not see as text: media, categories, and other-language links.
_HIDDEN_LINK = re.compile(r"^\s*:?\s*(file|image|media|category|[a-z]{2,3}(-[a-z]+)?)\s*:", re.IGNORECASE)
_BLANK_LINES = re.compile(r"\n{3,}")
_SPACES = re.compile(r"[ \t\u00a0]+")


def articles(xml: BinaryIO, path: str, skipped: Counter) -> Iterator[str]:
    """Plain text of each article page of a MediaWiki XML export, in dump order."""
    try:
        for page in _pages(xml):
            if page["ns"] != ARTICLE_NAMESPACE:
                skipped["wikipedia:non-article"] += 1
            elif page["redirect"] or page["text"].lstrip()[:9].upper() == "#REDIRECT":
                skipped["wikipedia:redirect"] += 1
            else:
                text = plain_text(page["text"])
                if text:
                    yield page["title"] + "\n\n" + text + "\n"
                else:
                    skipped["wikipedia:empty"] += 1
    except ElementTree.ParseError as error:
        raise ValueError(f"{path}: not a valid MediaWiki XML dump ({error}); expected "
                         "<mediawiki><page><title/><ns/><revision><text/></revision></page>...") from error


def _pages(xml: BinaryIO) -> Iterator[dict]:
    """{title, ns, redirect, text} of each <page>, elements freed as soon as they are read."""
    root = None
    for event, element in ElementTree.iterparse(xml, events=("start", "end")):
        if root is None:
            root = element
        if event != "end" or _local(element.tag) != "page":
            continue
        fields = {_local(child.tag): child for child in element.iter()}
        yield {"title": (fields["title"].text or "") if "title" in fields else "",
               "ns": (fields["ns"].text or "").strip() if "ns" in fields else ARTICLE_NAMESPACE,
               "redirect": "redirect" in fields,
               "text": (fields["text"].text or "") if "text" in fields else ""}
        root.clear()  # a dump holds millions of pages: keep none of them


def _local(tag: str) -> str:
    """'page' for '{http://www.mediawiki.org/xml/export-0.11/}page'."""
    return tag.rsplit("}", 1)[-1]


def plain_text(wikitext: str) -> str:
    """The prose of one article's wikitext (see the module docstring for what is kept)."""
    import mwparserfromhell  # only prep workers reading a dump need it

    code = mwparserfromhell.parse(wikitext)
    hidden = [*code.filter_templates(recursive=True), *code.filter_comments(recursive=True),
              *(tag for tag in code.filter_tags(recursive=True) if str(tag.tag).strip().lower() in DROPPED_TAGS),
              *(link for link in code.filter_wikilinks(recursive=True) if _HIDDEN_LINK.match(str(link.title)))]
    for node in hidden:
        try:
            code.remove(node)
        except ValueError:  # already gone with the node that held it
            pass
    text = code.strip_code(normalize=True, collapse=True)
    lines = (_SPACES.sub(" ", line).strip() for line in text.splitlines())
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()
