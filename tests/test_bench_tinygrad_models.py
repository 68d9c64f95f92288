"""hcq.bench.tinygrad_models (tinygrad's GPT-style forward and CNN training step, DEV=HCQ against DEV=CPU): its
arguments and its report; the models themselves run in the bench (minutes), not here."""
import pytest

from hcq.bench import tinygrad_models as tm


def test_bad_arguments_are_refused_with_what_is_allowed(capsys):
    with pytest.raises(SystemExit):
        tm.main(["--models", "gpt,resnet"])
    err = capsys.readouterr().err
    assert "unknown model(s) ['resnet']" in err and "choose from gpt, cnn" in err
    with pytest.raises(SystemExit):
        tm.main(["--rounds", "0"])


def test_the_report_gives_throughput_ratios_per_round_and_whether_the_numbers_match():
    res = {"gpt": {"s_per_call": {"HCQ": [0.02, 0.025], "CPU": [0.04, 0.03]}, "ratios": [2.0, 1.2], "identical": True, "max_abs_diff": 0.0},
           "cnn": {"s_per_call": {"HCQ": [0.01], "CPU": [0.01]}, "ratios": [1.0], "identical": False, "max_abs_diff": 1.5e-7}}
    lines = tm.report(res).splitlines()
    assert lines[2] == "| gpt | 44.4 | 28.6 | 2.00x, 1.20x | bit for bit |"
    assert lines[3] == "| cnn | 100.0 | 100.0 | 1.00x | no: max diff 1.5e-07 |"


def test_every_model_has_a_builder():
    assert set(tm.MODELS) == set(tm.BUILDERS)
