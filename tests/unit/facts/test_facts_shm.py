"""What a stopped engine leaves in /dev/shm: read from its processes' maps before the stop, removed by
exact path after it (real SGLang 0.5.23 leaves /dev/shm/sglang_loads_<name>_<hash>.shm at every stop)."""

from __future__ import annotations

import os
import subprocess

from pdops.facts import shm

# /proc/<pid>/maps lines of a real SGLang scheduler (lab, 2026-12-05), trimmed
MAPS = """\
7f2c1a000000-7f2c1a004000 rw-s 00000000 00:1a 1234 /dev/shm/sglang_loads_tmpq8x2kz1c_9decebdd.shm
7f2c1b000000-7f2c1b021000 rw-p 00000000 00:00 0
7f2c1c000000-7f2c1c004000 r--s 00000000 00:1a 99 /dev/shm/sem.mp-5z9g8imk (deleted)
7f2c1d000000-7f2c1d004000 r--p 00000000 fe:01 77 /usr/lib/x86_64-linux-gnu/libc.so.6
"""


def test_the_shm_paths_a_process_maps_are_read_from_its_maps_and_nothing_else():
    out = subprocess.run(["bash", "-c", f"printf '%s' {shm.q(MAPS)} | grep -o ' /dev/shm/[^ ]*$' | sort -u"],
                         capture_output=True, text=True).stdout
    assert shm.parse_paths(out) == ("/dev/shm/sglang_loads_tmpq8x2kz1c_9decebdd.shm",)
    # nothing outside /dev/shm, nothing below a folder of it, no traversal
    assert shm.parse_paths(" /etc/passwd\n /dev/shm/../etc/x\n /dev/shm/a/b\n /dev/shm/\n") == ()
    assert "/proc/12/maps /proc/345/maps" in shm.maps_command([345, 12])


def test_a_path_is_removed_only_when_it_is_a_file_no_process_maps(tmp_path):
    left = tmp_path / "sglang_loads_gone_1.shm"
    left.write_bytes(b"x" * 16)
    mapped = tmp_path / "sglang_loads_live_2.shm"
    mapped.write_bytes(b"y" * 8)
    # a process of this machine maps `mapped` (the check reads every /proc/<pid>/maps)
    holder = subprocess.Popen(["python3", "-c", "import mmap,sys,time; f=open(sys.argv[1],'r+b'); "
                               "m=mmap.mmap(f.fileno(),0); print('ok',flush=True); time.sleep(60)", str(mapped)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ok"
        out = subprocess.run(["bash", "-c", shm.remove_command([str(left), str(mapped), str(tmp_path / "none")])],
                             capture_output=True, text=True).stdout
    finally:
        holder.kill()
        holder.wait()
    removed, kept = shm.parse_removed(out)
    assert removed == [f"{left} (16 bytes)"], out
    assert kept == [f"{mapped}: still mapped", f"{tmp_path / 'none'}: gone"], out
    assert not left.exists() and mapped.exists()
    assert os.path.getsize(mapped) == 8
