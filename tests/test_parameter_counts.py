"""A model's docstring that states its parameter count states the count the model has (counted here)."""

import re

import pytest

from ddp_course.launch import REPO_ROOT, import_script
from ddp_course.models import DigitsCNN

COUNT_IN_DOCSTRING = re.compile(r"\((\d{1,3}(?:,\d{3})*) parameters\)")


def stated_count(model_class) -> int:
    match = COUNT_IN_DOCSTRING.search(model_class.__doc__)
    assert match, f"{model_class.__qualname__}'s docstring states no '(N parameters)': {model_class.__doc__!r}"
    return int(match.group(1).replace(",", ""))


def digits_net(path):
    return import_script(REPO_ROOT / path).DigitsNet


@pytest.mark.parametrize("model_class", [
    pytest.param(DigitsCNN, id="ddp_course.models.DigitsCNN"),
    pytest.param(digits_net("labs/train_realistic.py"), id="labs/train_realistic.py:DigitsNet"),
    pytest.param(digits_net("solutions/my_ddp.py"), id="solutions/my_ddp.py:DigitsNet"),
])  # fmt: skip
def test_the_docstring_states_the_models_parameter_count(model_class):
    assert stated_count(model_class) == sum(p.numel() for p in model_class().parameters())
