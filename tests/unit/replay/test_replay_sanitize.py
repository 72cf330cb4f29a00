"""compute-sanitizer memcheck reports are parsed and attributed to arguments."""

from __future__ import annotations

from moereplay.replay.sanitize import parse_report

LOG = """========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 4 bytes
=========     at void Marlin<(long)4, (long)5, 256, 1, 8, 8, false, 4, 1, false>(const int4 *, int4 *)+0x1a30
=========     by thread (12,0,0) in block (3,0,0)
=========     Address 0x7f00001100 is out of bounds
=========     and is 4 bytes after the nearest allocation at 0x7f00001000 of size 256 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========
========= Invalid __global__ read of size 4 bytes
=========     at void Marlin<(long)4, (long)5, 256, 1, 8, 8, false, 4, 1, false>(const int4 *, int4 *)+0x1a30
=========     by thread (13,0,0) in block (3,0,0)
=========     Address 0x7f000011fc is out of bounds
=========     and is 252 bytes after the nearest allocation at 0x7f00001000 of size 256 bytes
=========
========= Target application returned an error
========= ERROR SUMMARY: 2 errors
"""
STDOUT = (
    "MOEREPLAY-ARG input 0x7f00000000 4096\nMOEREPLAY-ARG topk_weights 0x7f00001000 256\nMOEREPLAY-DONE\n"
)


def test_memcheck_errors_are_attributed_to_the_argument_they_hit() -> None:
    errors, total = parse_report(LOG, STDOUT)
    assert total == 2 and len(errors) == 2
    assert {e.argument for e in errors} == {"topk_weights"}
    assert [e.offset for e in errors] == [4, 252] and errors[0].side == "after"
    assert errors[0].kind == "Invalid __global__ read of size 4 bytes"
    assert errors[0].kernel.startswith("void Marlin<")


def test_a_clean_log_has_no_errors() -> None:
    errors, total = parse_report("========= ERROR SUMMARY: 0 errors\n", "MOEREPLAY-DONE\n")
    assert errors == [] and total == 0
