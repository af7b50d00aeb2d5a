"""Vendor backends: one module per vendor (spec, compile, verify) plus its job script.

A ``<backend>.py`` module is imported while Snakemake parses the workflow, so it
keeps heavy imports inside functions; ``<backend>_job.py`` runs inside the
vendor's toolchain environment and never imports npuforge.
"""
