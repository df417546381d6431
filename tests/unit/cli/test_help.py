import pytest


@pytest.mark.parametrize("cmd", [[], ["validate"], ["plan"], ["model", "tiny"]])
def test_help_explains_with_examples(run_cli, cmd):
    code, out, _ = run_cli(*cmd, "--help")
    assert code == 0
    assert "Usage" in out
    if cmd and cmd != ["model"]:
        assert "Examples" in out and "pdctl " in out


def test_no_args_shows_help(run_cli):
    code, out, err = run_cli()
    assert "Usage" in out + err
