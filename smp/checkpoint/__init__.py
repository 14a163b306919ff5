"""Checkpoints: files written by several ranks and committed as a unit (:mod:`~smp.checkpoint.commit`), SMP v1's
``smp.save``/``smp.load`` (:mod:`~smp.checkpoint.save_load`), SMP (>= 1.10)'s tagged checkpoints
(:mod:`~smp.checkpoint.tagged`), the layout of a partitioned model's and optimizer's state dicts, with the
keys that mark them (:mod:`~smp.checkpoint.state_dicts`), and those state dicts across tensor-parallel degrees
(:mod:`~smp.checkpoint.tp_state`).

It may import :mod:`smp.runtime`; it reaches the model and the optimizer through the protocols of
:mod:`~smp.checkpoint.state_dicts`, never by importing the SMP surface, and it does not import :mod:`smp.engine`.
"""
