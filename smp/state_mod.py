"""SMP v1's module ``smdistributed.modelparallel.torch.state_mod``, where its state object lives: code written for
SMP imports it from there (the fp16 package beside SageMaker's 2022 GPT-2 script: ``from
smdistributed.modelparallel.torch.state_mod import state``). The object is :data:`smp.state`
(:mod:`smp.runtime.state_view`)."""
from smp.runtime.state_view import state

__all__ = ["state"]
