"""Code that runs inside a vendor's toolchain environment, never in the main one.

Each ``<backend>_job.py`` is run by path (``python <backend>_job.py spec.json``) with
the toolchain's own interpreter; it uses only the standard library, numpy and the
vendor toolkit, and imports its siblings here (``job_stage``, the QNN job's
``qnn_*.py``) as top-level modules (the script's directory is first on ``sys.path``;
a container mounts this whole directory). It never imports npuforge.
"""
