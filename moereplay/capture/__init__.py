"""capture: the vLLM general plugin and the recorder that writes MoE kernel calls while serving.

Layout: ``plugin`` (the entry point's tiny ``register()``), ``settings`` (``MOEREPLAY_*`` → one typed object),
``patch_points`` (where vLLM calls the kernels, as the families in ``moereplay/ops/`` declare it), ``patching`` (wrappers and the post-import hook),
``binding`` (arguments by name), ``context`` (step, layer, ranks), ``snapshot`` (copies at the right moment),
``recorder`` (filters and the wrapped call), ``flight`` (the flight recorder), ``opt_flags`` (triton_kernels'
process state around matmul_ogs), ``writer_thread``
and ``sink`` (bounded queue → capture file), ``session`` (arming one process).

Importing this package imports nothing heavy: vLLM imports the plugin in every process.
"""
