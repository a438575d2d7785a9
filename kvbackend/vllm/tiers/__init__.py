"""kvbackend's host-memory and disk tiers inside vLLM, laid out like vLLM's offloading
connector: ``planner`` (the scheduler side, plain Python, with its ``host_mirror``),
``worker`` (the byte mover's side), ``messages`` (what passes between them) and
``connector`` (the ``KVConnectorBase_V1`` that delegates to either by role).
The package imports nothing from vLLM until ``connector`` is imported."""
