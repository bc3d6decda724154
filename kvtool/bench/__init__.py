"""Benchmarks: what ``kvtool bench`` and the scripts under ``benchmarks/`` measure.

``matrix`` runs recipes over real caches through the .kvz container (ratio,
throughput, CPU time, sizes per K/V, layer and plane), ``bounds`` computes the
order-0 entropy limits of the same data, ``recipes`` names the recipe sets,
``report`` and ``plot`` present the results. The TTFT experiment (``ttft``,
``trace``) times restoring against recomputing.
"""
