"""natsim.integrations: natsim inside other libraries' models, a package per library: diffusers
(`natsim.integrations.diffusers.apply(transformer, sparsity=0.9)` and `remove(transformer)`). `import natsim`
does not load it, and nothing but the command line imports it.
"""
