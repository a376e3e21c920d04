"""Every task kind mgraph defines (with ``define_kind``, not only the TaskKind enum) has a CPU
body and a cost; the kinds without a megakernel (Triton) body are an explicit allow-list, which
must shrink when a body is added (the GPU issues such kinds as empty work today)."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache

from mgraph.kinds import KINDS, TaskKind

# Kinds the megakernel has no tile body for: graphs using them run on the reference backend.
NO_TRITON_BODY: set[str] = set()

_PROBE = """
import json, mgraph.ops
from mgraph.kinds import KINDS
print(json.dumps({k: [v.cpu_body is not None, v.flops_fn is not None,
                      v.triton_body is not None, sorted(r.value for r in v.roles)]
                  for k, v in KINDS.items()}))
"""


@cache
def builtin_kinds() -> dict[str, list]:
    """The kinds a fresh interpreter has after importing mgraph.ops: mgraph's own, none that a
    test registered with mg.register_op in this process."""
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_defined_kind_has_a_cpu_body_a_cost_and_roles():
    kinds = builtin_kinds()
    assert {k.value for k in TaskKind} <= set(kinds)
    assert len(kinds) >= 14
    for name, (cpu, cost, _triton, roles) in kinds.items():
        assert cpu, f"kind {name!r} has no CPU body: the reference runtime cannot run it"
        assert cost, f"kind {name!r} has no flops facet: the scheduler cannot cost it"
        assert roles, f"kind {name!r} runs in no role"


def test_kinds_without_a_triton_body_are_exactly_the_allow_list():
    kinds = builtin_kinds()
    missing = {name for name, (_c, _f, triton, _r) in kinds.items() if not triton}
    assert missing == NO_TRITON_BODY, (
        f"new Triton bodies for {sorted(NO_TRITON_BODY - missing)}: drop them from the list; "
        f"kinds without one that are not listed: {sorted(missing - NO_TRITON_BODY)}"
    )


def test_this_process_agrees_with_a_fresh_one():
    for name, (cpu, cost, triton, _roles) in builtin_kinds().items():
        spec = KINDS[name]
        assert (spec.cpu_body is not None, spec.flops_fn is not None,
                spec.triton_body is not None) == (cpu, cost, triton)
