"""The content-addressed artifact store and what keeps it in bounds.

- ``layout``: every folder, file and stage name on disk (work directory and store root);
- ``files``: streaming sha256 and atomic, fsynced writes; ``manifest``: ``Manifest``, ``FileRecord``,
  ``BuildResult``, ``ArtifactError``; ``code_version``: the source hash in every cache key;
- ``artifact_store``: ``ArtifactStore`` (keys, lookup and integrity, locks, produce, prune, heal);
  ``faults``: the ``QERL_FAULT`` crash-test hook;
- ``retention_policy`` (what each run keeps) and ``retention`` (``qerl gc``: plan and apply deletions).

Imports only ``qerl.pipeline.config`` and ``qerl.pipeline.runtime`` from the project; every other
sub-package of ``qerl.pipeline`` may import this one.
"""
