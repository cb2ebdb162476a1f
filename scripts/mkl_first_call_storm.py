#!/usr/bin/env python3
"""Reproduces oneMKL's VML first-call race, with and without torch_sac's fix.

ATen runs contiguous float ``sin`` (and 15 other functions) through MKL VML
on each intra-op thread's share; oneMKL 2024.2 picks the kernel on a
function's first call, and a first call on several threads at once can run a
low-accuracy kernel on one thread's share (pytorch/pytorch#188792). torch_sac
calls each VML function once on one element when imported
(``torch_sac/_compat.py``, ``settle_mkl_vml_dispatch``).

Forks ``--children`` fresh processes per arm, the arms interleaved, from a
parent that has run no op. Each child computes ``x.sin()`` of a 64x256 tensor
twice with ``--threads`` intra-op threads, the "settled" arm after the fix,
and the first and second results are compared bitwise. Prints how many
children of each arm differed. The race is rare (11 in 20000 children with 8
threads on a 2-core machine, 0 in 20000 settled): not a CI test.

    python scripts/mkl_first_call_storm.py [--children 5000] [--threads 8]
"""

import argparse
import importlib.util
import os
import pathlib
import sys

import torch

_COMPAT = pathlib.Path(__file__).resolve().parent.parent / "torch_sac" / "_compat.py"


def _load_compat():
    # _compat alone: importing the package would settle both arms. Loaded in
    # the parent (it runs no op), so the children only fork.
    spec = importlib.util.spec_from_file_location("torch_sac_compat", _COMPAT)
    compat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compat)
    return compat


def _child(compat, settled, threads):
    torch.set_num_threads(threads)
    if settled:
        compat.settle_mkl_vml_dispatch()
    torch.manual_seed(0)
    x = torch.randn(64, 256) + 1
    first, second = x.sin(), x.sin()
    os._exit(0 if torch.equal(first, second) else 3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--children", type=int, default=5000, help="per arm")
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    if not torch.backends.mkl.is_available():
        sys.exit("this torch has no MKL: nothing to reproduce")
    compat = _load_compat()
    differed = {False: 0, True: 0}
    for _ in range(args.children):
        for settled in (False, True):
            pid = os.fork()
            if pid == 0:
                _child(compat, settled, args.threads)
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            if code not in (0, 3):
                sys.exit(f"a child ended with {code}")
            differed[settled] += code == 3
    print(f"torch {torch.__version__}, {args.threads} threads, {args.children} children per arm")
    print(
        f"  first sin differed from the second: {differed[False]} without, {differed[True]} settled"
    )


if __name__ == "__main__":
    main()
