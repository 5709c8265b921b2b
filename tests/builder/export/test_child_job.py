"""ChildJob: a function run in a spawned process gives back its value or its error, and ends with its caller."""

import operator
import os
import time

import pytest

from specbuild.builder.export.child_job import ChildJob
from specbuild.errors import SpecbuildError


def refuse(what):
    raise SpecbuildError(f"export validation: output {what} differs")


def divide(a, b):
    return a / b


def test_value_comes_back():
    with ChildJob("adding", operator.add, [1, 2], [3]) as job:
        assert job.result() == [1, 2, 3]


def test_a_refusal_keeps_its_message_and_any_other_error_its_traceback():
    with ChildJob("checking", refuse, "logits") as job, pytest.raises(SpecbuildError, match="output logits differs"):
        job.result()
    with ChildJob("dividing", divide, 1, 0) as job, pytest.raises(RuntimeError) as error:
        job.result()
    assert "ZeroDivisionError" in str(error.value) and "in divide" in str(error.value)


def test_a_child_that_dies_is_an_error_naming_the_job():
    with ChildJob("checking the truncated network", os._exit, 3) as job, pytest.raises(SpecbuildError) as error:
        job.result()
    assert "checking the truncated network" in str(error.value) and "exit code 3" in str(error.value)


def test_the_child_ends_when_its_caller_fails():
    with pytest.raises(KeyError), ChildJob("sleeping", time.sleep, 60) as job:
        raise KeyError("the caller's own failure")
    assert not job._process.is_alive()
