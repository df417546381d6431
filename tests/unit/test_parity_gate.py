"""The parity gate's pure parts: prompt ordering, recorded reference answers, the warm-up's error line."""

from pdctl.gates.parity import Prompt, _in_cache_order, first_divergence
from pdctl.launch.run import _connector_error


def test_shared_prefix_prompts_come_in_a_second_wave():
    prompts = [Prompt(ids=[1], label="random-1"), Prompt(ids=[1, 2], label="prefix1+1"),
               Prompt(ids=[3], label="random-3"), Prompt(text="q", label="gsm8k-0")]
    assert _in_cache_order(prompts) == ([0, 2, 3], [1])


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # a shorter answer diverges where it ends


def test_warm_up_error_is_the_error_line_not_the_connectors_info(tmp_path):
    log = tmp_path / "decode.log"
    log.write_text(
        "INFO [nixl.py:1] pdctl connector: backend CPU_ATTN, block 64\n"
        "ERROR [base_worker.py:1318] NIXL transfer failure: handshake_setup_failed | Context: {...}\n"
        "INFO [nixl.py:2] pdctl connector: advertising CPU attention ISA vec (block 64)\n")
    assert _connector_error(str(log)).startswith("NIXL transfer failure: handshake_setup_failed")
    log.write_text("ERROR RuntimeError: pdctl connector: unsupported P/D pair (prefill: block 64 ...)\n"
                   "INFO pdctl connector: advertising CPU attention ISA vec (block 32)\n")
    assert _connector_error(str(log)) == "pdctl connector: unsupported P/D pair (prefill: block 64 ...)"
    log.write_text("INFO pdctl connector: advertising CPU attention ISA vec (block 32)\n")
    assert _connector_error(str(log)) is None


def test_only_a_handshake_timeout_is_worth_another_warm_up(tmp_path):
    from pdctl.launch.run import _handshake_timed_out

    log = tmp_path / "decode.log"
    log.write_text("ERROR NIXL transfer failure: handshake_failed | Context: {}\nERROR zmq.error.Again: Resource "
                   "temporarily unavailable\n")
    assert _handshake_timed_out(str(log))
    log.write_text("ERROR NIXL transfer failure: handshake_setup_failed\n"
                   "ERROR RuntimeError: pdctl connector: unsupported P/D pair (...)\n")
    assert not _handshake_timed_out(str(log))
