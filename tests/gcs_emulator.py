"""The GCS emulator the tests use (``gcp-storage-emulator``), with two GCS behaviours it
lacks and TensorStore relies on:

- a media download answers with the object's ``x-goog-generation`` and
  ``x-goog-metageneration`` headers. Without them TensorStore reads generation 0, and its
  next conditional write of that object (OCDBT's manifest) fails with "Malformed
  StorageGeneration" (seen as a flaky ``CheckpointManager`` save on gs://);
- an upload with ``ifGenerationMatch`` is refused with 412 unless the object's generation
  matches (``0``: the object must not exist), as GCS does.

Usage: ``python gcs_emulator.py start --port PORT --in-memory --default-bucket NAME`` (the
emulator's own command line).
"""

from __future__ import annotations

import sys
import threading
from http import HTTPStatus

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_download = objects.download
_insert = objects.insert
_lock = threading.Lock()


def _generation(storage, bucket: str, name: str) -> str | None:
    try:
        return str(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        return None


def download(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except NotFound:
        return
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))


def insert(request, response, storage, *args, **kwargs):
    wanted = request.query.get("ifGenerationMatch")
    if not wanted:
        return _insert(request, response, storage, *args, **kwargs)
    with _lock:  # the check and the write as one step
        name = (request.query.get("name") or [None])[0]
        current = _generation(storage, request.params["bucket_name"], name) if name else None
        if name is not None and (current or "0") != wanted[0]:
            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json({"error": {"code": 412, "message": "conditionNotMet"}})
            return None
        return _insert(request, response, storage, *args, **kwargs)


objects.download = download
objects.insert = insert

if __name__ == "__main__":
    from gcp_storage_emulator.__main__ import main  # builds its routes from the patched module

    main(sys.argv[1:])
