"""Running the doctor's checks in order.

Owns: the order of the check groups (driver, toolkit, runtime, kubelet, dra, devices, agent)
and the loop boundary around each check: a check that raises is reported as a failure naming
the error (logged once with its trace), and the others still run. Must not hold checks of its own.
"""

from __future__ import annotations

import logging

from agent.doctor import devnodes, dra, driver, kubelet, runtime, service, toolkit
from agent.doctor.context import Context
from agent.doctor.model import Check, Spec, fail

log = logging.getLogger(__name__)

SPECS: tuple[Spec, ...] = (
    driver.CHECKS + toolkit.CHECKS + runtime.CHECKS + kubelet.CHECKS + dra.CHECKS
    + devnodes.CHECKS + service.CHECKS
)


def run_checks(ctx: Context, specs: tuple[Spec, ...] = SPECS) -> list[Check]:
    """Every check's result, in order."""
    out = []
    for spec in specs:
        try:
            finding = spec.run(ctx)
        except Exception as exc:  # the loop boundary: one broken check must not hide the rest
            log.error("doctor check %s failed unexpectedly", spec.id, exc_info=True)
            finding = fail(f"the check itself failed: {type(exc).__name__}: {exc}",
                           "report this as a gpu-agent bug, with the trace above")
        out.append(Check.of(spec, finding))
    return out
