"""Authoring tools: what a maintainer runs to write, store and check the course, never what a learner needs.

    python -m ddp_course.authoring.notebooks PATH.ipynb      # re-execute a notebook, store its outputs
    python -m ddp_course.authoring.portability [PATH ...]    # re-run notebooks under other CPU numerics
    python -m ddp_course.authoring.exercises --notebooks     # generate exercise cells from the solutions
    python -m ddp_course.authoring.budget                    # the route's reading and exercise time
    python -m ddp_course.authoring.notation                  # where each symbol is used, and defined
    python -m ddp_course.authoring.website                   # the course as a static website

CONTRIBUTING.md says when to run each; the figures' code is in ddp_course/diagrams/.
"""
