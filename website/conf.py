"""Sphinx configuration of the course's website. Build it with `python -m ddp_course.authoring.website` (not sphinx-build):
that command first writes the course as a Sphinx source tree (ddp_course/authoring/website.py) and checks it.

Offline by design: nothing is executed (the notebooks' stored outputs are shown), maths is rendered to
MathML at build time (no MathJax from a CDN), and no widget JavaScript is loaded.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the course_site extension beside this file

project = "Data parallelism with PyTorch DDP"
html_title = "Data parallelism with PyTorch DDP, by running it"
author = "the course's authors"
extensions = ["myst_nb", "course_site"]

nb_execution_mode = "off"  # the stored outputs, exactly as `pytest --nbval` checked them
nb_merge_streams = True
nb_render_markdown_format = "myst"  # our figure outputs are MyST image directives with alt text
nb_ipywidgets_js = {}  # the default loads require.js and the widget manager from CDNs
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 4  # GitHub's anchors (README.md#syllabus), so the notebooks' links keep working
html_math_renderer = "mathml"  # course_site renders $...$ with latex2mathml

html_theme = "sphinx_book_theme"
html_theme_options = {
    "show_navbar_depth": 1,
    "home_page_in_toc": False,
    "use_download_button": False,
    "use_fullscreen_button": False,
    "navigation_with_keys": False,
}
html_context = {"default_mode": "auto"}  # unset, the theme's script logs "Got invalid theme mode" as an error
html_static_path = ["_static"]
html_css_files = ["course.css"]
html_js_files = ["course.js"]
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = None
exclude_patterns = ["_doctrees", "**/.ipynb_checkpoints"]
# The solutions notebooks jump from their title (H1) to exercise headings (H3), as in JupyterLab: not an error.
suppress_warnings = ["myst.header"]
