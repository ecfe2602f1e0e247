"""Steps the planner was to measure and could not, for a cause a script repeats every step.

A step is not measured when its timings would not be one step's: it ran several backwards,
a forward of the model ran before it (between steps), it trained without a step of the
attached optimizer, or its passes ran inside ``optimizer.step(closure)`` after the runtime
read the step. Once in a while (an evaluation, a skipped step) that costs nothing; every step
(pytorch/examples' DCGAN loop does two of them), and the planner has nothing to plan from:
the split stays as it is, without a word. :class:`LostSteps` says so once, with the fix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

SEVERAL_BACKWARDS, FORWARD_BETWEEN = "several backwards", "a forward between steps"
UNSTEPPED, CLOSURE = "no optimizer step", "a closure"
CAUSES = {
    SEVERAL_BACKWARDS: (
        "each ran several backwards (a GAN's discriminator on real, then on fake samples), "
        "whose timings cannot be told apart",
        "run one backward a step: sum the losses and backward once (errD = errD_real + "
        "errD_fake; model.backward(errD)), after as many forwards as it takes"),
    FORWARD_BETWEEN: (
        "a forward of this model ran between steps (a GAN generator's step through this "
        "discriminator, or an evaluation every step), which the next step's timings would "
        "hold",
        "call the plain module between steps, model.module(x): no DDP forward, and no "
        "all-reduce of gradients that the next step's zero_grad() drops"),
    UNSTEPPED: (
        "each ran a backward but ended without a step of the optimizer given to attach() "
        "(gradients summed over several of the loader's steps before one update, another "
        "optimizer stepping, or AMP's GradScaler skipping every step: its gradients "
        "overflowed)",
        "take one step of the attached optimizer per step of the loader (to accumulate over "
        "more samples, raise batch_size; max_local_batch= and max_micro_batches= bound each "
        "worker's memory)"),
    CLOSURE: (
        "each ran its forwards and backwards inside optimizer.step(closure) (LBFGS), after "
        "the runtime reads the step's timings",
        "train with an optimizer that steps without a closure: one that evaluates it "
        "several times a step cannot be planned"),
}
"""Each cause: what it is, and its fix."""
SAID_AFTER = 10
"""Steps in a row, each to be measured, that a cause kept unmeasured before it is said."""


@dataclass
class LostSteps:
    """The steps in a row that the planner was to measure and :data:`CAUSES` kept from it."""

    lost: int = 0
    causes: set[str] = field(default_factory=set)
    said: bool = False
    """The warning was given (once a run)."""

    def count(self, causes: set[str], measured: bool, rank: int,
              split: tuple[int, ...] | None) -> None:
        """Count a step the planner was to measure (``measured``: it was; ``causes``: why
        not), and log a warning once when :data:`SAID_AFTER` in a row were lost. A
        measured step starts the count over; one lost for no cause of these leaves it."""
        if measured:
            self.lost, self.causes = 0, set()
        if measured or not causes:
            return
        self.lost += 1
        self.causes |= causes
        if self.lost < SAID_AFTER or self.said:
            return
        self.said = True
        said = [CAUSES[cause] for cause in sorted(self.causes)]
        logger.warning("rank %d: none of the last %d steps the planner was to measure could "
                       "be: %s. With nothing to plan from, the split stays %s (the gradients "
                       "are right: only the speed-up is lost). To be planned, %s", rank,
                       self.lost, "; and ".join(what for what, _ in said), list(split or ()),
                       "; and ".join(fix for _, fix in said))
