"""The GPU check's reading of /proc/self/maps (tests/ops/test_msda_cuda.py: which libcudart the op runs on), on a
fake maps text, so that the GPU-only test's reading is checked on every machine."""

from __future__ import annotations

from msda_cases import loaded_libraries

MAPS = """\
55d0c0a00000-55d0c0a2e000 r--p 00000000 fd:01 1316 /opt/venv/bin/python3.12
7f1c20000000-7f1c20021000 rw-p 00000000 00:00 0
7f1c3a000000-7f1c3a0a0000 r--p 00000000 fd:01 9001 /opt/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13
7f1c3a0a0000-7f1c3a100000 r-xp 000a0000 fd:01 9001 /opt/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13
7f1c3b000000-7f1c3b200000 r-xp 00000000 fd:01 9100 /opt/trainstack/trainer/ops/msda/_C.cpython-312-x86_64-linux-gnu.so
7f1c3c000000-7f1c3c001000 r--p 00000000 fd:01 9200 /usr/local/cuda-13.3/lib/libcudart_static_notes.txt (deleted)
7ffd5a1e0000-7ffd5a201000 rw-p 00000000 00:00 0                          [stack]
"""


def test_each_loaded_library_of_a_name_is_listed_once():
    assert loaded_libraries(MAPS, "libcudart") == [
        "/opt/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13",
        "/usr/local/cuda-13.3/lib/libcudart_static_notes.txt (deleted)",
    ]
    assert loaded_libraries(MAPS, "_C.") == ["/opt/trainstack/trainer/ops/msda/_C.cpython-312-x86_64-linux-gnu.so"]
    assert loaded_libraries(MAPS, "[stack]") == [] and loaded_libraries("", "libcudart") == []


def test_two_runtimes_in_one_process_are_both_seen():
    both = MAPS + "7f1c4000-7f1c5000 r-xp 00000000 fd:01 9300 /usr/local/cuda/lib64/libcudart.so.13\n"
    assert loaded_libraries(both, "libcudart.so")[-1] == "/usr/local/cuda/lib64/libcudart.so.13"
    assert len(loaded_libraries(both, "libcudart.so")) == 2
