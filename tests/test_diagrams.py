"""Every figure in assets/ is drawn by code (ddp_course/diagrams/) and is current: a change to what a
figure shows, or to how it is drawn, fails here until `python -m ddp_course.diagrams` redraws it."""

import json

import pytest

from ddp_course import diagrams

MODULES = diagrams.available_modules()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", MODULES, ids=[module.NAME for module in MODULES])
def test_the_committed_figure_is_current(module):
    assert diagrams.stale(module) is None, diagrams.stale(module)


@pytest.mark.timeout(60)
def test_a_changed_description_is_caught(tmp_path, monkeypatch):
    """The check can fail: a diagram whose description no longer matches its committed record is stale."""

    class Fake:
        NAME, TITLE = "fake_diagram", "a fake diagram"

        @staticmethod
        def describe():
            return {"boxes": ["a", "b"]}

    monkeypatch.setattr(diagrams, "ASSETS", tmp_path)
    monkeypatch.setattr(diagrams, "fingerprint", lambda module: "0123")
    assert diagrams.stale(Fake) == "fake_diagram: not drawn yet"
    record = {"name": Fake.NAME, "title": Fake.TITLE, "source_fingerprint": "0123", "description": {"boxes": ["a", "b"]}}
    (tmp_path / "fake_diagram.json").write_text(json.dumps(record))
    (tmp_path / "fake_diagram.png").write_bytes(b"png")
    assert diagrams.stale(Fake) is None
    Fake.describe = staticmethod(lambda: {"boxes": ["a", "c"]})
    assert diagrams.stale(Fake) == "fake_diagram: what it shows changed since it was drawn"
    monkeypatch.setattr(diagrams, "fingerprint", lambda module: "4567")
    assert diagrams.stale(Fake) == "fake_diagram: its drawing code changed since it was drawn"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module", MODULES, ids=[module.NAME for module in MODULES])
def test_the_website_can_describe_the_figure_in_words(module):
    """Every figure gets alt text on the website from its committed description; a new figure without a
    describer once failed only in the website build, after the whole suite had passed."""
    from ddp_course.authoring import website

    alt_text = website.diagram_alt_texts(diagrams.ASSETS.parent)[f"assets/{module.NAME}.png"]
    assert len(alt_text.split()) >= 20, alt_text


@pytest.mark.timeout(60)
def test_every_stored_plot_in_a_notebook_has_alt_text_for_the_website():
    """A plot drawn by a function in ddp_course leaves no title or axis label in its cell, so the website
    cannot derive its alt text: it needs a description in website/figure_alt.json. Checked here, in the
    main suite, because the website build only runs after the whole suite (a rehearsal once failed there)."""
    from ddp_course.authoring import portability, website
    from ddp_course.launch import REPO_ROOT

    written = website.load_figure_alt(REPO_ROOT)
    problems = []
    for path in portability.all_notebooks():
        relative = path.relative_to(REPO_ROOT).as_posix()
        _, found = website.image_alt_texts(relative, json.loads(path.read_text()), written)
        problems += found
    assert problems == [], "\n".join(problems)
