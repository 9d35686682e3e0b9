"""Wikipedia dumps: articles streamed out of the (bz2) XML as the prose a reader sees."""
import bz2
import os
from collections import Counter
from xml.sax.saxutils import escape

from tfbig.data import prepare, source_spec, sources

ADA = """{{Infobox person|name=Ada|birth_date={{birth date|1815|12|10}}}}
'''Ada Lovelace''' was an [[England|English]] [[mathematician]].<ref>Smith, ''Lives'', p. 3.</ref> She wrote \
about the [[Analytical Engine]].<ref name="x"/>

== Early life ==
Her father was [[Lord Byron]].{{citation needed|date=2020}} See [https://example.org the site].
[[File:Ada.jpg|thumb|Ada in 1840 with [[Lord Byron|Byron]]]]
{| class="wikitable"
! Year !! Event
|-
| 1843 || Notes
|}
<!-- editors: keep this short -->
Notes &amp; letters&nbsp;survive.
* first item
* second item
[[Category:Mathematicians]]
[[de:Ada Lovelace]]
"""
ADA_TEXT = ("Ada Lovelace\n\nAda Lovelace was an English mathematician. She wrote about the Analytical Engine.\n\n"
            "Early life\nHer father was Lord Byron. See the site.\n\nNotes & letters survive.\nfirst item\n"
            "second item\n")
ENGINE = "The '''Analytical Engine''' was designed by [[Charles Babbage]]."


def _page(title, ns, text, redirect=None):
    extra = f'<redirect title="{redirect}" />' if redirect else ""
    return (f"<page><title>{escape(title)}</title><ns>{ns}</ns><id>1</id>{extra}<revision><id>2</id>"
            f'<text bytes="{len(text)}" xml:space="preserve">{escape(text)}</text></revision></page>')


def _dump(path):
    pages = [_page("Ada Lovelace", 0, ADA), _page("Lovelace", 0, "#REDIRECT [[Ada Lovelace]]", "Ada Lovelace"),
             _page("Talk:Ada Lovelace", 1, "Is the infobox right? ~~~~"), _page("Analytical Engine", 0, ENGINE),
             _page("Template:Infobox person", 10, "{{{name}}}")]
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/" version="0.11" xml:lang="en">'
           "<siteinfo><sitename>Wikipedia</sitename></siteinfo>" + "".join(pages) + "</mediawiki>\n")
    path.write_bytes(bz2.compress(xml.encode()))
    return path


def test_articles_are_the_prose_a_reader_sees_and_the_rest_is_counted(tmp_path):
    path = _dump(tmp_path / "enwiki-20240601-pages-articles1.xml.bz2")
    spec = source_spec.SourceSpec(inputs=(str(tmp_path),))  # found by the directory search
    skipped = Counter()
    docs = [doc for piece in sources.plan_pieces(spec, 1 << 20)
            for doc in sources.read_documents(piece, spec, Counter(), skipped)]
    assert docs == [ADA_TEXT, "Analytical Engine\n\nThe Analytical Engine was designed by Charles Babbage.\n"]
    assert skipped == {"wikipedia:redirect": 1, "wikipedia:non-article": 2}
    assert str(path) in sources.resolve_files(spec.inputs)


def test_prepared_dump_counts_skipped_pages_in_the_manifest(tmp_path, multi_shard_dir):
    path = _dump(tmp_path / "wiki.xml.bz2")
    manifest = prepare([str(path)], str(tmp_path / "out"), 16, 400, tokenizer=os.path.join(multi_shard_dir,
                       "tokenizer.model"), validation_fraction=0)
    assert manifest.info["skipped"]["train"] == {"wikipedia:non-article": 2, "wikipedia:redirect": 1}
    assert manifest.split("train").records > 0
