"""The content-addressed artifact store and what keeps it in bounds.

- ``layout``: every folder, file and stage name on disk (work directory and store root);
- ``files``: streaming sha256, atomic, fsynced writes and the disk-full error; ``manifest``: ``Manifest``, ``FileRecord``,
  ``BuildResult``, ``ArtifactError``; ``code_version``: the source hash in every cache key;
- ``artifact_store``: ``ArtifactStore`` (keys, lookup and integrity, locks, produce, prune, heal);
  ``integrity``: how a cache hit is checked (``QERL_VERIFY``: hashed once per store object by default);
  ``faults``: the ``QERL_FAULT`` crash-test hook;
- ``retention_policy`` (what each run keeps) and ``retention`` (``qerl gc``: plan and apply deletions);
  ``retention_inputs``: the error a consumer of a pruned adapter gets (the step, the file, why).

Imports only ``qerl.pipeline.config`` and ``qerl.pipeline.runtime`` from the project; every other
sub-package of ``qerl.pipeline`` may import this one.
"""
