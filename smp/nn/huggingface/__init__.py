"""``smp.nn.huggingface``: SMP v1's support of Hugging Face models by its distributed modules.

One module per model family (:mod:`smp.nn.huggingface.gpt2`, ``bert``, ``roberta``, ``gptj``, ``gptneo``): the
distributed module's arguments from the model's config (SMP's init hook), the call hooks, and the state-dict
translators both ways under SMP v1's published names; the shared hooks in :mod:`smp.nn.huggingface.hooks` and the
key-mapping rules in :mod:`smp.nn.huggingface.mapping`. Importing them imports ``transformers`` only when a hook
runs.
"""
