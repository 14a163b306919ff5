"""Fast variants of SageMaker's data-parallel MNIST example, run by tests/smp/test_smddp.py through ``smp launch
--as-smdistributed``; their model and data (:mod:`~tests.smp.smddp_scripts.model_def`) are also the single-process
reference's."""
