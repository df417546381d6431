from pdctl.bench import host

STAT = """cpu  1000 10 200 5000 40 0 30 120 0 0
cpu0 500 5 100 2500 20 0 15 60 0 0
cpu1 500 5 100 2500 20 0 15 60 0 0
intr 1 2 3
"""


def test_the_aggregate_cpu_line_gives_steal_idle_and_total_ticks_and_the_cpu_lines_their_count():
    assert host.parse_stat(STAT) == host.CpuTimes(steal=120, total=1000 + 10 + 200 + 5000 + 40 + 0 + 30 + 120,
                                                  idle=5000 + 40, cpus=2)
    # Not a /proc/stat: nothing, rather than a number from the wrong line.
    assert host.parse_stat("cpu0 1 2 3 4 5 6 7 8\n") is None
    assert host.parse_stat("cpu 1 2 3\n") is None and host.parse_stat("cpu a b c d e f g h\n") is None


def test_steal_is_the_share_of_cpu_time_other_guests_took_between_two_readings():
    before = host.CpuTimes(steal=100, total=1000, idle=0, cpus=2)
    assert host.steal_share(before, host.CpuTimes(steal=125, total=1100, idle=0, cpus=2)) == 0.25
    # negative control: none taken
    assert host.steal_share(before, host.CpuTimes(steal=100, total=1100, idle=0, cpus=2)) == 0.0
    assert host.steal_share(before, before) is None  # no time passed: no share
    assert host.steal_share(None, before) is None and host.steal_share(before, None) is None


def test_busy_cores_are_the_non_idle_share_of_the_ticks_times_the_cpus_stolen_time_left_out():
    before = host.CpuTimes(steal=0, total=1000, idle=400, cpus=2)
    # 1000 ticks over 2 CPUs: 250 idle -> 1.5 cores busy
    assert host.busy_cores(before, host.CpuTimes(steal=0, total=2000, idle=650, cpus=2)) == 1.5
    # the same span with 100 ticks stolen: this guest's own work is 650 of 1000
    assert host.busy_cores(before, host.CpuTimes(steal=100, total=2000, idle=650, cpus=2)) == 1.3
    # negative control: an idle host is 0 busy, not the CPU count
    assert host.busy_cores(before, host.CpuTimes(steal=0, total=2000, idle=1400, cpus=2)) == 0.0
    assert host.busy_cores(before, before) is None and host.busy_cores(None, before) is None


def test_a_host_without_proc_stat_reports_no_steal(tmp_path):
    assert host.cpu_times(tmp_path / "absent") is None
    (tmp_path / "stat").write_text(STAT)
    assert host.cpu_times(tmp_path / "stat").steal == 120


def test_a_process_groups_cpu_time_sums_its_members_user_and_system_ticks(tmp_path):
    import os

    hz = os.sysconf("SC_CLK_TCK")

    def proc(pid, pgid, utime, stime, comm="python3 (x)"):
        # /proc/<pid>/stat: pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
        (tmp_path / str(pid)).mkdir()
        fields = f"S 1 {pgid} {pgid} 0 -1 0 0 0 0 0 {utime} {stime} 0 0"
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) {fields}\n")

    proc(10, 10, 3 * hz, hz)
    proc(11, 10, hz, 0, comm="VLLM::EngineCore)")  # a ')' in the name does not shift the fields
    proc(12, 99, 50 * hz, 0)  # another group: not counted
    (tmp_path / "self").mkdir()
    assert host.group_cpu_seconds(10, tmp_path) == 5.0
    assert host.group_cpu_seconds(99, tmp_path) == 50.0
    assert host.group_cpu_seconds(7, tmp_path) is None  # no such group: unknown, not zero
    assert host.group_cpu_seconds(10, tmp_path / "absent") is None
    # several groups from one pass: the same numbers
    assert host.groups_cpu_seconds([10, 99, 7], tmp_path) == {10: 5.0, 99: 50.0, 7: None}
    assert host.groups_cpu_seconds([10], tmp_path / "absent") == {10: None}
