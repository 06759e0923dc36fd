"""The course's Sphinx extension: route navigation, the stamp, deep-dive marks, diagram alt text, MathML.

It reads _course_site.json, which `python -m ddp_course.authoring.website` writes into the source tree it stages.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from docutils import nodes
from latex2mathml.converter import convert as latex_to_mathml

TAGS = {"[deep dive]": "deep-dive", "[core]": "core"}


def course(app) -> dict:
    if not hasattr(app, "course_site"):
        app.course_site = json.loads((Path(app.srcdir) / "_course_site.json").read_text())
    return app.course_site


# --- maths: MathML written at build time, which browsers render without any script ---------------


def visit_inline_math(self, node):
    self.body.append(latex_to_mathml(node.astext()))
    raise nodes.SkipNode


def visit_block_math(self, node):
    self.body.append(f'<div class="math-block">{latex_to_mathml(node.astext(), display="block")}</div>')
    raise nodes.SkipNode


# --- sections: [core] and [deep dive] become visible marks; deep-dive sections get a class ---------


def mark_sections(app, doctree):
    for section in doctree.findall(nodes.section):
        title = section.next_node(nodes.title)
        if title is None or not title.children or not isinstance(title.children[-1], nodes.Text):
            continue
        text = str(title.children[-1])
        for tag, css in TAGS.items():
            if text.rstrip().endswith(tag):
                section["classes"].append(css)
                title.children[-1].parent.replace(title.children[-1], nodes.Text(text.rstrip()[: -len(tag)]))
                title += nodes.inline(tag.strip("[]"), tag.strip("[]"), classes=["course-tag", f"course-tag-{css}"])


# --- the diagrams: alt text from their committed descriptions ----------------------------------


def describe_diagrams(app, doctree):
    alt_texts = course(app)["diagram_alt"]
    for image in doctree.findall(nodes.image):
        for path, alt in alt_texts.items():
            if image["uri"].endswith(path):
                image["alt"] = alt


# --- every page: the stamp, and on a route page its step, Before and Next ---------------------------


def route_banner(app, pagename: str) -> str:
    route = course(app)["route"]
    docs = [step["doc"] for step in route]
    if pagename not in docs:
        return ""
    index = docs.index(pagename)
    deep = " (a deep dive as a whole)" if route[index]["step"] in course(app)["deep_dive_steps"] else ""

    def link(css: str, words: str, target: int) -> str:
        uri = app.builder.get_relative_uri(pagename, docs[target])
        return f'<a class="{css}" href="{html.escape(uri)}">{words}</a>'

    before = (
        link("route-before", f"&larr; Before: step {index}, {route[index - 1]['step']}", index - 1)
        if index
        else f'<a class="route-before" href="{html.escape(app.builder.get_relative_uri(pagename, "index"))}">&larr; The syllabus</a>'
    )
    after = (
        link("route-next", f"Next: step {index + 2}, {route[index + 1]['step']} &rarr;", index + 1)
        if index + 1 < len(docs)
        else '<span class="route-next route-end">The end of the route</span>'
    )
    here = f'<span class="route-here">Route step {index + 1} of {len(docs)}: {route[index]["step"]}{deep}</span>'
    return f'<nav class="course-route" aria-label="the route">{before}{here}{after}</nav>'


def add_stamp_and_route(app, pagename, templatename, context, doctree):
    if "body" not in context:
        return
    banner = route_banner(app, pagename)
    toggle = (
        ('<p class="course-core-toggle"><label><input type="checkbox" class="core-only-switch"> Core path only: fold the deep-dive sections</label></p>')
        if doctree is not None and any("deep-dive" in section["classes"] for section in doctree.findall(nodes.section))
        else ""
    )
    context["body"] = course(app)["stamp_html"] + banner + toggle + context["body"] + banner


def stamp_in_every_footer(app, config):
    """The stamp in the footer of every page, the search page and the index too (the top of a content page has it as well)."""
    config.html_theme_options = {**config.html_theme_options, "extra_footer": course(app)["stamp_html"]}


def setup(app):
    app.connect("config-inited", stamp_in_every_footer)
    app.add_html_math_renderer("mathml", (visit_inline_math, None), (visit_block_math, None))
    app.connect("doctree-read", mark_sections, priority=100)
    app.connect("doctree-read", describe_diagrams)
    app.connect("html-page-context", add_stamp_and_route)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
