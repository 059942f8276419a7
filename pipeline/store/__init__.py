"""The content-addressed artifact store and what keeps it in bounds.

- ``layout``: every folder, file and stage name on disk (work directory and store root);
- ``files``: streaming sha256, atomic, fsynced writes and the disk-full error; ``manifest``: ``Manifest``, ``FileRecord``,
  ``BuildResult``, ``ArtifactError``; ``code_version``: the source hash in every cache key;
- ``artifact_store``: ``ArtifactStore`` (keys, lookup and integrity, locks, produce, prune, heal) and
  ``open_store`` (the work directory's store, a cache of the shared store ``store.uri`` names);
  ``integrity``: how a cache hit is checked (``QERL_VERIFY``: hashed once per store object by default);
  ``faults``: the ``QERL_FAULT`` crash-test hook;
- ``shared``: the fleet's shared store (S3 or a shared mount): content-addressed blobs, one manifest
  per key published last and only if absent, fetches hashed while written; ``shared_backends``: its
  two kinds (S3, a POSIX mount) and ``store.uri``'s rules;
- ``retention_policy`` (what each run keeps) and ``retention`` (``qerl gc``: plan and apply deletions);
  ``retention_inputs``: the error a consumer of a pruned adapter gets (the step, the file, why).

Imports only ``qerl.pipeline.config``, ``qerl.pipeline.runtime`` and ``qerl.pipeline.fleet`` (the
shared store's run leases and build locks) from the project; every other sub-package of
``qerl.pipeline`` may import this one.
"""
