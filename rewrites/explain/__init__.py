"""What a rewrite run did to one graph, for a person: text or one HTML page.

    result = fx_rewrites.apply(program, rules, explain=True)
    e = explanation(program, result, rules, title="net.py:make", backend="iree")
    print(render_text(e))
    Path("net.html").write_text(render_html(e))

`explanation` (build.py) reads the graph before the rules, the graph after
them (each created node carries its provenance in `meta["rewrites"]`) and
the run's match attempts (`Report.explain()`, so `apply(..., explain=True)`)
into plain data (data.py); `render_text` (text.py) and `render_html`
(page.py) turn that into a string. All three are pure: they neither change
the graphs nor print. The page is self-contained (inline CSS, no scripts,
no external assets), escapes every name, repr and reason it shows, and
lets a reader jump to each rewritten node or show the changed rows only.
"""

from fx_rewrites.explain.build import explanation, format_value
from fx_rewrites.explain.data import MAX_ARGS, SHOWN_CANDIDATES, Explanation, Line, NearMiss, Rewrite
from fx_rewrites.explain.page import render_html
from fx_rewrites.explain.text import render_text

__all__ = [
    "MAX_ARGS",
    "SHOWN_CANDIDATES",
    "Explanation",
    "Line",
    "NearMiss",
    "Rewrite",
    "explanation",
    "format_value",
    "render_html",
    "render_text",
]
