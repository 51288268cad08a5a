"""Which model versions are served: a config, version policies, polling, and hot swap.

Every `poll` lists each model's base path, loads the versions its policy wants that are not
loaded yet, and only then retires the ones it no longer wants, so there is always a version
serving. A request holds a lease on its version; a retired version is closed when its last
lease ends, so a swap never fails a request in flight. A version that fails to load is retried
`max_load_retries` times (TF Serving's `--max_num_load_retries`; it stays LOADING meanwhile),
then reported in the status (state END with the error) and left alone; the previous one keeps
serving.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from typing import Callable, Iterator

from google.protobuf import text_format
from tensorflow.core.protobuf import error_codes_pb2
from tensorflow_serving.apis import get_model_status_pb2
from tensorflow_serving.config import model_server_config_pb2

from tworec.serving.errors import ServingError, from_tf_error
from tworec.serving.layout import list_versions
from tworec.serving.model import LoadedModel

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One served model.

    Attributes:
        name: the name requests use.
        base_path: the folder holding integer version folders.
        policy: "latest", "all" or "specific" (TF Serving's `model_version_policy`).
        num_versions: how many of the latest versions `latest` serves.
        versions: the versions `specific` serves.
        labels: version label -> version.
    """
    name: str
    base_path: str
    policy: str = "latest"
    num_versions: int = 1
    versions: tuple[int, ...] = ()
    labels: dict = dataclasses.field(default_factory=dict)

    def wanted(self, on_disk: list[int]) -> set[int]:
        """The versions to serve out of those on disk (increasing)."""
        if self.policy == "all":
            return set(on_disk)
        if self.policy == "specific":
            return set(on_disk) & set(self.versions)
        return set(on_disk[-self.num_versions:])


def parse_config(text: str) -> list[ModelConfig]:
    """The models of a text `ModelServerConfig` (only `model_config_list` is supported)."""
    try:
        proto = text_format.Parse(text, model_server_config_pb2.ModelServerConfig())
    except text_format.ParseError as error:
        raise ServingError("INVALID_ARGUMENT", f"Invalid model config: {error}") from error
    return configs_of_proto(proto)


def configs_of_proto(proto: model_server_config_pb2.ModelServerConfig) -> list[ModelConfig]:
    if proto.WhichOneof("config") == "custom_model_config":
        raise ServingError("UNIMPLEMENTED", "custom_model_config is not supported")
    return [_config_of_proto(config) for config in proto.model_config_list.config]


def _config_of_proto(config) -> ModelConfig:
    policy = config.model_version_policy
    choice = policy.WhichOneof("policy_choice") or "latest"
    return ModelConfig(
        name=config.name, base_path=config.base_path, policy=choice,
        num_versions=max(policy.latest.num_versions, 1),
        versions=tuple(policy.specific.versions), labels=dict(config.version_labels))


@dataclasses.dataclass
class _Version:
    state: str = "LOADING"   # LOADING, AVAILABLE, UNLOADING, END (TF Serving's state names)
    error: ServingError | None = None
    model: LoadedModel | None = None
    leases: int = 0


class ModelManager:
    """Loads, serves and retires model versions.

    Args:
        configs: the models to serve.
        poll_seconds: seconds between polls of the base paths; 0 or less polls once, at start.
        load: builds a servable from a version folder (the default loads it like TF Serving).
        max_load_retries: attempts after a failed load before the version is given up (END).
        load_retry_seconds: the wait between those attempts.
    """

    def __init__(self, configs: list[ModelConfig], poll_seconds: float = 1.0,
                 load: Callable[[str], LoadedModel] = LoadedModel, max_load_retries: int = 0,
                 load_retry_seconds: float = 60.0):
        self.poll_seconds = poll_seconds
        self._load = load
        self.max_load_retries, self.load_retry_seconds = max_load_retries, load_retry_seconds
        self._lock = threading.Lock()
        self._configs = {c.name: c for c in configs}
        self._versions: dict[str, dict[int, _Version]] = {c.name: {} for c in configs}
        self._stop = threading.Event()
        self._poll_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Loads what the configs want now, then polls in a background thread."""
        self.poll()
        if self.poll_seconds > 0:
            self._thread = threading.Thread(target=self._poll_loop, name="model-poll",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stops polling and closes every loaded version."""
        self._stop.set()
        if self._thread:
            self._thread.join()
        with self._lock:
            for name in list(self._versions):
                self._retire(name, set(self._versions[name]))

    def reload(self, configs: list[ModelConfig]) -> None:
        """Replaces the whole model list and polls at once; models left out, or moved to
        another base path, are unloaded."""
        new = {c.name: c for c in configs}
        with self._lock:
            for name, old in self._configs.items():
                if name not in new or new[name].base_path != old.base_path:
                    self._retire(name, set(self._versions[name]))
                    del self._versions[name]
            self._configs = new
            for name in new:
                self._versions.setdefault(name, {})
        self.poll()

    def poll(self) -> None:
        """One pass over every model: load the versions wanted, then retire the others."""
        with self._poll_lock:
            with self._lock:
                configs = list(self._configs.values())
            for config in configs:
                self._poll_model(config)

    @contextlib.contextmanager
    def lease(self, name: str, version: int | None = None,
              label: str | None = None) -> Iterator[tuple[int, LoadedModel]]:
        """Holds a serving version for the duration of a request.

        Args:
            name: the model name.
            version: a specific version, or None for the latest available one.
            label: a version label of the config (instead of `version`).

        Yields:
            (version, the loaded model).

        Raises:
            ServingError: NOT_FOUND when no such version is available.
        """
        with self._lock:
            number, entry = self._serving_version(name, version, label)
            entry.leases += 1
        try:
            yield number, entry.model
        finally:
            with self._lock:
                entry.leases -= 1
                if entry.state == "UNLOADING" and entry.leases == 0:
                    self._close(entry)

    def status(self, name: str, version: int | None = None,
               label: str | None = None) -> get_model_status_pb2.GetModelStatusResponse:
        """The state of every version of `name`, or of one version; NOT_FOUND if unknown."""
        with self._lock:
            versions = self._versions.get(name)
            if not versions:
                raise ServingError("NOT_FOUND", f"Could not find any versions of model {name}")
            if label is not None:
                version = self._label_version(name, label)
            if version is not None and version not in versions:
                raise ServingError("NOT_FOUND",
                                   f"Could not find version {version} of model {name}")
            response = get_model_status_pb2.GetModelStatusResponse()
            for number in sorted(versions, reverse=True):
                if version is None or number == version:
                    _add_status(response, number, versions[number])
        return response

    def watch_config_file(self, path: str, poll_seconds: float) -> None:
        """Reloads the model list whenever the text config at `path` changes (checked every
        `poll_seconds`, TF Serving's `--model_config_file_poll_wait_seconds`). A config that
        does not parse is logged and the current one kept."""
        def loop(mtime: float) -> None:
            while not self._stop.wait(poll_seconds):
                try:
                    if os.path.getmtime(path) == mtime:
                        continue
                    mtime = os.path.getmtime(path)
                    with open(path) as f:
                        self.reload(parse_config(f.read()))
                except (OSError, ServingError) as error:
                    log.error("reloading the model config %s failed: %s", path, error)
        threading.Thread(target=loop, args=(os.path.getmtime(path),), name="config-poll",
                         daemon=True).start()

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.poll()
            except Exception:  # a poll must never end the loop
                log.exception("polling the model base paths failed")

    def _poll_model(self, config: ModelConfig) -> None:
        on_disk = list_versions(config.base_path)
        with self._lock:
            if config.name not in self._versions:       # removed by a concurrent reload
                return
            known = self._versions[config.name]
            new = sorted(v for v in self._wanted(config, on_disk)
                         if v not in known or known[v].state == "END")
            for number in new:
                known[number] = _Version()
        for number in new:
            self._load_version(config, number)
        with self._lock:
            if config.name in self._versions:           # the wanted ones, failures left out
                self._retire(config.name, set(self._versions[config.name])
                             - self._wanted(config, on_disk))

    def _wanted(self, config: ModelConfig, on_disk: list[int]) -> set[int]:
        """The versions to serve: the policy's choice among those that did not fail to load."""
        known = self._versions[config.name]
        return config.wanted([v for v in on_disk if v not in known or known[v].error is None])

    def _load_version(self, config: ModelConfig, number: int) -> None:
        """Loads a version and records the outcome; a failure is kept in its status."""
        path = os.path.join(config.base_path, str(number))
        for attempt in range(self.max_load_retries + 1):
            try:
                model = self._load(path)
                break
            except Exception as error:
                log.error("loading %s version %d from %s failed (attempt %d of %d): %s",
                          config.name, number, path, attempt + 1, self.max_load_retries + 1,
                          error)
                failed = from_tf_error(error)
            if attempt == self.max_load_retries or self._stop.wait(self.load_retry_seconds):
                self._record(config.name, number, _Version(
                    "END", ServingError(failed.code, f"{path}: {failed.message}")))
                return
        log.info("serving %s version %d from %s", config.name, number, path)
        if not self._record(config.name, number, _Version("AVAILABLE", model=model)):
            model.close()

    def _record(self, name: str, number: int, entry: _Version) -> bool:
        """Stores a version's entry; False when a reload removed the model meanwhile."""
        with self._lock:
            versions = self._versions.get(name)
            if versions is not None:
                versions[number] = entry
            return versions is not None

    def _retire(self, name: str, numbers: set[int]) -> None:
        """Stops serving versions (lock held); each closes when its last lease ends."""
        for number in numbers:
            entry = self._versions[name][number]
            if entry.state == "AVAILABLE":
                entry.state = "UNLOADING"
                if entry.leases == 0:
                    self._close(entry)

    @staticmethod
    def _close(entry: _Version) -> None:
        entry.model.close()
        entry.model = None
        entry.state = "END"

    def _serving_version(self, name: str, version: int | None,
                         label: str | None) -> tuple[int, _Version]:
        """The version a request names (lock held)."""
        if label is not None:
            version = self._label_version(name, label)
        available = {v: e for v, e in self._versions.get(name, {}).items()
                     if e.state == "AVAILABLE"}
        if version is None:
            if not available:
                raise ServingError("NOT_FOUND", f"Servable not found for request: Latest({name})")
            version = max(available)
        if version not in available:
            raise ServingError("NOT_FOUND",
                               f"Servable not found for request: Specific({name}, {version})")
        return version, available[version]

    def _label_version(self, name: str, label: str) -> int:
        labels = self._configs[name].labels if name in self._configs else {}
        if label not in labels:
            raise ServingError("INVALID_ARGUMENT",
                               f"Unrecognized servable version label: {label}")
        return labels[label]


def _add_status(response: get_model_status_pb2.GetModelStatusResponse, number: int,
                entry: _Version) -> None:
    status = response.model_version_status.add(version=number)
    status.state = get_model_status_pb2.ModelVersionStatus.State.Value(entry.state)
    status.status.SetInParent()          # TF Serving always reports it, OK included
    if entry.error is not None:
        status.status.error_code = error_codes_pb2.Code.Value(entry.error.code)
        status.status.error_message = entry.error.message
