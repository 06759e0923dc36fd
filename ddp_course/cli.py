"""Command-line plumbing: user mistakes end in one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import os
import sys
import time


class CourseError(Exception):
    """A problem the learner can fix (bad flag, missing data, unusable checkpoint).

    Labs catch it in main(), print its one-line message once for the job and exit with status 1.
    Raise it on every rank alike (each rank reaches the same verdict from the same inputs), so
    no rank is left waiting in a collective for one that has already quit.
    """


# How long a quiet rank waits, after a bad flag, for rank 0 to report it (bounded: never a hang).
QUIET_RANK_GRACE_S = 15.0


class CourseArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag once per job instead of once per rank.

    Every torchrun worker parses the same command line, so every worker would print the same
    usage and error; rank 0 speaks, the others exit with the same status 2 - but not at once:
    torchrun stops every worker as soon as one fails, and a rank that quit first could get rank 0
    killed before it has printed (seen here when rank 0 was still importing torch). Rank 0 reaches
    the same error within seconds, and its exit makes torchrun stop the waiting ranks.
    """

    def error(self, message: str):  # noqa: D102 - same contract as argparse
        if os.environ.get("RANK", "0") == "0":
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        else:
            time.sleep(QUIET_RANK_GRACE_S)
        sys.exit(2)


def positive_int(text: str) -> int:
    value = _parse(text, int, "an integer")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = _parse(text, int, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def positive_float(text: str) -> float:
    value = _parse(text, float, "a number")
    if not value > 0 or value == float("inf"):  # `not >` also rejects nan
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def int_list(text: str) -> list[int]:
    """ "1,2,4" -> [1, 2, 4], each a positive integer (for sweeps over world sizes)."""
    return [positive_int(part) for part in text.split(",")]


def float_list(text: str) -> list[float]:
    """ "1,25,100" -> [1.0, 25.0, 100.0], each a positive number."""
    return [positive_float(part) for part in text.split(",")]


def name_list(text: str) -> list[str]:
    """ "a,b" -> ["a", "b"]; empty names are refused."""
    names = [part.strip() for part in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _parse(text: str, kind, description: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {description}, got {text!r}") from None
