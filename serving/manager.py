"""Which model versions are served: a config, version policies, polling, and hot swap.

Every `poll` lists each model's base path, loads the versions its policy wants that are not
loaded yet, and only then retires the ones it no longer wants, so there is always a version
serving. A request holds a lease on its version; a retired version is closed when its last
lease ends, so a swap never fails a request in flight. A version that fails to load is retried
`max_load_retries` times (TF Serving's `--max_num_load_retries`; it stays LOADING meanwhile;
the retries stop once the version is no longer wanted: its folder gone or a later one there),
then reported in the status (state END with the error) and left alone; the previous one keeps
serving, as TF Serving's availability-preserving policy keeps the last serving version while
none of those its policy wants is AVAILABLE. A model moved to another base path by a reload
is swapped the same way (see `ModelManager.reload`). Each model has one worker thread of its
own that lists, loads and retries its versions, so a slow or failing version never delays
another model, the ports or a reload. Status messages name the model and version, never a
server path.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator

from google.protobuf import text_format
from tensorflow.core.protobuf import error_codes_pb2
from tensorflow_serving.apis import get_model_status_pb2
from tensorflow_serving.config import model_server_config_pb2

from tworec.serving.errors import ServingError, echo, from_tf_error
from tworec.serving.layout import list_versions
from tworec.serving.model import LoadedModel

RETRY_CHECK_SECONDS = 0.5      # how often a version waiting to retry its load checks it is wanted

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
    return configs_of_proto(config_proto(text))


def config_proto(text: str) -> model_server_config_pb2.ModelServerConfig:
    """A text `ModelServerConfig`; INVALID_ARGUMENT when it does not parse."""
    try:
        return text_format.Parse(text, model_server_config_pb2.ModelServerConfig())
    except text_format.ParseError as error:
        raise ServingError("INVALID_ARGUMENT", f"Invalid model config: {error}") from error


def configs_of_proto(proto: model_server_config_pb2.ModelServerConfig) -> list[ModelConfig]:
    """The models of a `ModelServerConfig` (none when it sets no config); INVALID_ARGUMENT
    when a name is listed twice or a model names no platform or one other than tensorflow,
    as TF Serving refuses them."""
    if proto.WhichOneof("config") == "custom_model_config":
        raise ServingError("UNIMPLEMENTED", "custom_model_config is not supported")
    configs = [_config_of_proto(config) for config in proto.model_config_list.config]
    _check_unique(configs)
    return configs


def reload_configs(proto: model_server_config_pb2.ModelServerConfig) -> list[ModelConfig]:
    """The models a reload to `proto` serves. FAILED_PRECONDITION, as TF Serving's
    `ServerCore::ReloadConfig` answers, for a config that sets no model list (an empty
    request, or a config file emptied or caught half-written): a server serving a list moves
    only to another list, so nothing is unloaded."""
    if proto.WhichOneof("config") is None:
        raise ServingError("FAILED_PRECONDITION", "Cannot transition to requested config. It is "
                           "only legal to transition from one ModelConfigList to another.")
    return configs_of_proto(proto)


def _config_of_proto(config: model_server_config_pb2.ModelConfig) -> ModelConfig:
    platform = config.model_platform                     # as TF Serving's GetPlatform reads it
    if config.model_type != model_server_config_pb2.MODEL_TYPE_UNSPECIFIED:
        if platform:
            raise ServingError("INVALID_ARGUMENT", "Illegal setting both ModelServerConfig::"
                               "model_type (deprecated) and ModelServerConfig::model_platform, "
                               f"model name is {echo(config.name)}")
        if config.model_type != model_server_config_pb2.TENSORFLOW:
            raise ServingError("INVALID_ARGUMENT", "ModelServerConfig::model_type choice "
                               f"{config.model_type} not supported.")
        platform = "tensorflow"
    if not platform:
        raise ServingError("INVALID_ARGUMENT", "Illegal setting neither ModelServerConfig::"
                           "model_type (deprecated) nor ModelServerConfig::model_platform, model "
                           f'name is {echo(config.name)}; set model_platform: "tensorflow"')
    if platform != "tensorflow":
        raise ServingError("INVALID_ARGUMENT", f"Model {echo(config.name)} requests unsupported "
                           f"platform {echo(platform)}; this server serves model_platform "
                           '"tensorflow"')
    policy = config.model_version_policy
    choice = policy.WhichOneof("policy_choice") or "latest"
    return ModelConfig(
        name=config.name, base_path=config.base_path, policy=choice,
        num_versions=max(policy.latest.num_versions, 1),
        versions=tuple(policy.specific.versions), labels=dict(config.version_labels))


@dataclasses.dataclass
class _Version:
    path: str                # the version folder it is loaded from
    state: str = "LOADING"   # LOADING, AVAILABLE, UNLOADING, END (TF Serving's state names)
    error: ServingError | None = None
    model: LoadedModel | None = None
    leases: int = 0
    attempts: int = 0
    cancelled: bool = False  # its retries stopped once it was no longer wanted: not failed


@dataclasses.dataclass
class _Model:
    """A configured model: its versions, and the one worker thread that lists, loads and
    retries them, so that a slow or failing version never holds up another model (sessions
    close on threads of their own, see `ModelManager._close`)."""
    config: ModelConfig
    versions: dict[int, _Version] = dataclasses.field(default_factory=dict)
    # After a move to another base path: the new path's copies of versions that the old path's
    # copies serve meanwhile, while they load; and the folders whose copy failed (not retried).
    incoming: dict[int, _Version] = dataclasses.field(default_factory=dict)
    failed_moves: set[str] = dataclasses.field(default_factory=set)
    worker: ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="model-load"))
    removed: threading.Event = dataclasses.field(default_factory=threading.Event)
    poll: Future | None = None
    listed: ModelConfig | None = None      # the config whose base path was last listed
    listing_error: str | None = None       # why the last listing failed, logged when it changes

    def tried(self) -> bool:
        """Listed under its current config, and every version it wants has had a load
        attempt."""
        return self.listed is self.config and all(
            v.attempts or v.state != "LOADING"
            for v in [*self.versions.values(), *self.incoming.values()])


class ModelManager:
    """Loads, serves and retires model versions.

    Args:
        configs: the models to serve.
        poll_seconds: seconds between polls of the base paths; 0 or less polls once, at start.
        load: builds a servable from a version folder (the default loads it like TF Serving).
        max_load_retries: attempts after a failed load before the version is given up (END).
        load_retry_seconds: the wait between those attempts.
        allowed_roots: folders, besides the base paths of `configs`, under which
            `check_allowed` accepts base paths (`--allowed_model_roots`).
    """

    def __init__(self, configs: list[ModelConfig], poll_seconds: float = 1.0,
                 load: Callable[[str], LoadedModel] = LoadedModel, max_load_retries: int = 0,
                 load_retry_seconds: float = 60.0, allowed_roots: list[str] = ()):
        self.poll_seconds = poll_seconds
        self._load = load
        self.max_load_retries, self.load_retry_seconds = max_load_retries, load_retry_seconds
        self.allowed_roots = [os.path.realpath(path) for path in
                              [c.base_path for c in configs] + list(allowed_roots)]
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._reloading = threading.Lock()        # one reload at a time, labels included
        _check_unique(configs)
        self._models = {c.name: _Model(c) for c in configs}
        # The versions of models a reload removed, for their status alone: TF Serving's state
        # monitor keeps a removed model's END states, so its status still answers.
        self._removed_versions: dict[str, dict[int, _Version]] = {}
        self._labels = {c.name: dict(c.labels) for c in configs}   # name -> label -> version
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closing: list[threading.Thread] = []

    def start(self, wait: bool = True) -> None:
        """Starts loading what the configs want, then polls in a background thread.

        Args:
            wait: return only once every initial version is AVAILABLE or given up (END).
        """
        self.poll()
        if self.poll_seconds > 0:
            self._thread = threading.Thread(target=self._poll_loop, name="model-poll",
                                            daemon=True)
            self._thread.start()
        if wait:
            self.wait_until_settled()

    def wait_until_settled(self, names: list[str] | None = None,
                           timeout: float | None = None) -> bool:
        """Waits until each model has listed its base path under its current config and no
        version of theirs is LOADING; False if `timeout` seconds passed first. (By state, not
        by the polls' futures: polls slower than the poll interval always leave one running.)"""
        def settled() -> bool:
            return all(model.listed is model.config and all(
                version.state != "LOADING"
                for version in [*model.versions.values(), *model.incoming.values()])
                for name, model in self._models.items() if names is None or name in names)
        with self._changed:
            return self._changed.wait_for(settled, timeout)

    def check_started(self) -> None:
        """Refuses a start-up as TF Serving's server does: UNKNOWN when the latest version a
        model's policy wants ended with a load error ("N servable(s) did not become
        available"), then FAILED_PRECONDITION when a label points at a version that is not
        AVAILABLE. Call it once `wait_until_settled` returned."""
        with self._lock:
            failed = []
            for name, model in self._models.items():
                latest = model.versions[max(model.versions)] if model.versions else None
                if latest is not None and latest.error is not None and not latest.cancelled:
                    failed.append(f"{{{{name: {name} version: {max(model.versions)}}} due to "
                                  f"error: {latest.error.message}}}, ")
            if failed:
                raise ServingError("UNKNOWN", f"{len(failed)} servable(s) did not become "
                                   f"available: {{{''.join(failed)}}}")
            self._update_labels([model.config for model in self._models.values()])

    def stop(self) -> None:
        """Stops polling and loading, and closes every loaded version."""
        self._stop.set()
        if self._thread:
            self._thread.join()
        with self._lock:
            for name in list(self._models):
                self._remove(name)                # notifies a reload waiting for them
            closing, self._closing = self._closing, []
        for thread in closing:
            thread.join()

    def check_allowed(self, configs: list[ModelConfig]) -> None:
        """Refuses (PERMISSION_DENIED) a config whose base path is neither served now nor
        under an allowed root; what `HandleReloadConfigRequest` may load."""
        with self._lock:
            served = {os.path.realpath(m.config.base_path) for m in self._models.values()}
        for config in configs:
            if not os.path.isabs(config.base_path):
                raise ServingError("INVALID_ARGUMENT", f"Model {echo(config.name)}: base_path must "
                                   "be an absolute path")
            path = os.path.realpath(config.base_path)
            if path not in served and not any(_under(path, root) for root in self.allowed_roots):
                raise ServingError("PERMISSION_DENIED", f"Model {echo(config.name)}: base_path is "
                                   "outside the folders this server may load models from "
                                   "(--allowed_model_roots)")

    def reload(self, configs: list[ModelConfig], wait_seconds: float | None = None) -> None:
        """Replaces the whole model list; models left out are unloaded.

        A model moved to another base path keeps serving its old versions until the new
        path's are loaded: the new path's wanted versions load, then the old ones retire (all
        of them if one new version is AVAILABLE, else all but the latest, as for a failed
        version on one path). A version number found on both paths is loaded again from the
        new path and swapped in once AVAILABLE, its old copy serving until then; if the new
        copy fails to load, the old one keeps serving and the error is logged. (TF Serving
        keys servables by name and version and keeps serving the old path's copy for as long
        as the version is wanted.)

        Returns once each new or moved model has listed its base path and made a first load
        attempt of each version it wants (or after `wait_seconds`); retries of a failing
        version go on in the background. Then, as TF Serving does, the version labels are
        checked: if one points at a version that is not AVAILABLE, every model keeps its
        previous labels and the reload fails (FAILED_PRECONDITION) with its models applied.
        """
        _check_unique(configs)
        with self._reloading:                     # as TF Serving holds its config lock
            self._reload(configs, wait_seconds)

    def _reload(self, configs: list[ModelConfig], wait_seconds: float | None) -> None:
        new = {c.name: c for c in configs}
        with self._lock:
            if self._stop.is_set():               # nothing would load: the wait never ends
                raise ServingError("UNAVAILABLE", "The server is stopping; the model config "
                                   "was not reloaded")
            for name in list(self._models):
                if name not in new:
                    self._remove(name)
            changed = [name for name, config in new.items() if name not in self._models
                       or self._models[name].config.base_path != config.base_path]
            for name, config in new.items():
                if name in self._models:
                    if name in changed:               # a new path: its copies are tried anew
                        self._models[name].failed_moves.clear()
                    self._models[name].config = config
                else:
                    self._models[name] = _Model(config)
            self._labels = {name: labels for name, labels in self._labels.items()
                            if name in new}
        self.poll()
        with self._changed:
            self._changed.wait_for(lambda: self._stop.is_set() or all(
                self._models[n].tried() for n in changed if n in self._models), wait_seconds)
            self._update_labels(configs)

    def _update_labels(self, configs: list[ModelConfig]) -> None:
        """Takes the configs' labels if each points at an AVAILABLE version (lock held)."""
        for config in configs:
            model = self._models.get(config.name)    # None if a later reload removed it
            versions = model.versions if model else {}
            for version in config.labels.values():
                if version not in versions or versions[version].state != "AVAILABLE":
                    raise ServingError(
                        "FAILED_PRECONDITION", f"Request to assign label to version {version} "
                        f"of model {echo(config.name)}, which is not currently available for "
                        "inference")
        self._labels = {config.name: dict(config.labels) for config in configs}

    def poll(self) -> None:
        """Asks every model's worker to list its base path, load the versions wanted and
        retire the others. A model whose poll is running gets one more queued behind it (it
        reads the config when it starts, so a reload meanwhile is never missed); one already
        queued and not started is enough."""
        with self._lock:
            for model in self._models.values():
                if model.poll is None or model.poll.running() or model.poll.done():
                    model.poll = model.worker.submit(self._poll_model, model)

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

    def status(self, name: str, version: int | None = None
               ) -> get_model_status_pb2.GetModelStatusResponse:
        """The state of every version of `name`, or of one version; NOT_FOUND if unknown. A
        model a reload removed keeps its versions' last states (END once unloaded), as TF
        Serving's state monitor keeps them; re-added, its new versions' states replace them
        version by version. A label is not asked for: TF Serving's status reads the version alone and answers every
        version when a request names a label (`GetModelStatusWithModelSpec`)."""
        with self._lock:
            versions = {**self._removed_versions.get(name, {}),
                        **(self._models[name].versions if name in self._models else {})}
            if not versions:
                raise ServingError("NOT_FOUND",
                                   f"Could not find any versions of model {echo(name)}")
            if version is not None and version not in versions:
                raise ServingError("NOT_FOUND",
                                   f"Could not find version {version} of model {echo(name)}")
            response = get_model_status_pb2.GetModelStatusResponse()
            for number in sorted(versions, reverse=True):
                if version is None or number == version:
                    _add_status(response, number, versions[number])
        return response

    def watch_config_file(self, path: str, poll_seconds: float) -> None:
        """Reloads the model list whenever the text config at `path` changes (checked every
        `poll_seconds`, TF Serving's `--model_config_file_poll_wait_seconds`). A config that
        is not text, does not parse or is refused (`reload_configs`: an emptied file) is logged
        and the current one kept."""
        def loop(mtime: float) -> None:
            refused = None                                  # logged once, until it changes
            while not self._stop.wait(poll_seconds):
                try:
                    if os.path.getmtime(path) == mtime:
                        continue
                    mtime = os.path.getmtime(path)
                    with open(path) as f:
                        self.reload(reload_configs(config_proto(f.read())))
                    refused = None
                except (OSError, UnicodeDecodeError, ServingError) as error:
                    if str(error) != refused:
                        log.error("reloading the model config %s failed: %s", path, error)
                    refused = str(error)
                    mtime = None          # read again next poll: a write may end in one tick
        threading.Thread(target=loop, args=(os.path.getmtime(path),), name="config-poll",
                         daemon=True).start()

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.poll()
            except Exception:  # a poll must never end the loop
                log.exception("polling the model base paths failed")

    def _poll_model(self, model: _Model) -> None:
        """On the model's worker: loads the new versions it wants, then retires the others,
        both by the config as it was when the poll started (a reload meanwhile queues another
        poll, which follows the new config; retiring by it here could retire the version
        serving before its replacement is loaded)."""
        with self._lock:
            config = model.config
        try:
            on_disk = _versions_on_disk(config.base_path)
        except Exception as error:      # anything: the model must still count as listed
            if str(error) != model.listing_error:       # once, not at every poll
                log.error("listing the versions of model %s failed: %s", config.name, error)
            model.listing_error = str(error)
            with self._changed:                         # what is served stays as it is
                model.listed = config
                self._changed.notify_all()
            return
        model.listing_error = None
        loads = []
        with self._lock:
            for number in sorted(self._wanted(model, config, on_disk)):
                path = os.path.join(config.base_path, str(number))
                entry = model.versions.get(number)
                if entry is None or entry.state == "END":
                    model.versions[number] = _Version(path)
                    loads.append((number, model.versions[number]))
                elif (entry.path != path and entry.state == "AVAILABLE"
                      and path not in model.failed_moves):   # moved: load the new copy
                    model.incoming[number] = _Version(path)
                    loads.append((number, model.incoming[number]))
            model.listed = config
            self._changed.notify_all()
        for number, entry in loads:
            self._load_version(model, number, entry)
        with self._lock:
            if not model.removed.is_set():              # the wanted ones, failures left out
                self._retire(model, self._unwanted(model, config, on_disk))

    @staticmethod
    def _wanted(model: _Model, config: ModelConfig, on_disk: list[int]) -> set[int]:
        """The versions `config` serves: its policy's choice among those that did not fail
        to load from its base path."""
        def failed(number: int) -> bool:
            entry = model.versions.get(number)
            return (entry is not None and entry.error is not None and not entry.cancelled
                    and entry.path == os.path.join(config.base_path, str(number)))
        return config.wanted([v for v in on_disk if not failed(v)])

    def _unwanted(self, model: _Model, config: ModelConfig, on_disk: list[int]) -> set[int]:
        """The versions to retire (lock held): those `_wanted` leaves out, except that while
        the policy wants versions of which none is AVAILABLE (loading or failed), the latest
        serving one stays, as in TF Serving's availability-preserving policy."""
        wanted = self._wanted(model, config, on_disk)
        unwanted = set(model.versions) - wanted
        serving = {v for v in unwanted if model.versions[v].state == "AVAILABLE"}
        if serving and config.wanted(on_disk) and not any(
                model.versions[v].state == "AVAILABLE" for v in wanted if v in model.versions):
            unwanted.discard(max(serving))
        return unwanted

    def _load_version(self, model: _Model, number: int, entry: _Version) -> None:
        """Loads a version into `entry`, retrying on failure; the outcome is kept in its status
        (or, for a moved model's new copy, the copy is swapped in, or the failure logged)."""
        name, path = model.config.name, entry.path
        for attempt in range(self.max_load_retries + 1):
            if model.removed.is_set() or self._stop.is_set():
                return
            try:
                loaded = self._load(path)
                break
            except Exception as error:
                log.error("loading %s version %d from %s failed (attempt %d of %d): %s",
                          name, number, path, attempt + 1, self.max_load_retries + 1, error)
                failed = from_tf_error(error, f"loading version {number} of model {name}")
            self._record(model, entry, attempts=attempt + 1)
            retry = "no" if attempt == self.max_load_retries else self._wait_to_retry(
                model, number, path)
            if retry == "yes":
                continue
            self._record(model, entry, state="END", cancelled=retry == "unwanted",
                         error=ServingError(failed.code, f"Version {number} of model {name} "
                                            f"failed to load: {failed.message}"))
            with self._changed:
                if model.incoming.get(number) is entry:       # the old copy keeps serving
                    del model.incoming[number]
                    if retry == "no":                 # a cancelled copy may load again
                        model.failed_moves.add(path)
            return
        log.info("serving %s version %d from %s", name, number, path)
        if not self._record(model, entry, state="AVAILABLE", model=loaded,
                            attempts=attempt + 1):
            loaded.close()

    def _wait_to_retry(self, model: _Model, number: int, path: str) -> str:
        """Waits `load_retry_seconds` before a failed version's next attempt: "yes" then, "no"
        at once when the model is removed or the server stops, "unwanted" at once when the
        poll would no longer load the version (its folder gone, a later one there, the config
        changed: `_wanted`), as TF Serving cancels the retries of a version that leaves its
        aspired set. The model's one worker must not hold a good version back behind a broken
        one's retries. Without polling (`poll_seconds` <= 0) the wanted versions never change,
        as in TF Serving, and nothing is cancelled."""
        deadline = time.monotonic() + self.load_retry_seconds
        if self.poll_seconds <= 0:
            return "no" if model.removed.wait(self.load_retry_seconds) or \
                self._stop.is_set() else "yes"
        while (left := deadline - time.monotonic()) > 0:
            if model.removed.wait(min(left, RETRY_CHECK_SECONDS)):
                return "no"
            with self._lock:
                config = model.config
            try:
                on_disk = _versions_on_disk(config.base_path)
            except Exception:          # unlisted: as a poll, change nothing; keep waiting
                continue
            with self._lock:
                wanted = self._wanted(model, config, on_disk)
            if path != os.path.join(config.base_path, str(number)) or number not in wanted:
                log.info("%s version %d is no longer wanted; its load is not retried",
                         config.name, number)
                return "unwanted"
        return "no" if model.removed.is_set() or self._stop.is_set() else "yes"

    def _record(self, owner: _Model, entry: _Version, **fields) -> bool:
        """Updates a version's entry, and swaps a moved model's new copy in once AVAILABLE;
        False when a reload removed the model meanwhile."""
        with self._changed:
            if not owner.removed.is_set():
                for key, value in fields.items():
                    setattr(entry, key, value)
                number = next((n for n, e in owner.incoming.items() if e is entry), None)
                if number is not None and entry.state == "AVAILABLE":
                    old = owner.versions[number]
                    owner.versions[number] = owner.incoming.pop(number)
                    self._retire_entry(old)
            self._changed.notify_all()
            return not owner.removed.is_set()

    def _remove(self, name: str) -> None:
        """Unloads every version of a model and stops its worker (lock held); their states stay
        in the status."""
        model = self._models.pop(name)
        model.removed.set()
        for entry in model.versions.values():
            if entry.state == "LOADING":            # its load is dropped (`_record`)
                entry.state = "END"
        self._removed_versions.setdefault(name, {}).update(model.versions)
        self._retire(model, set(model.versions))
        model.worker.shutdown(wait=False, cancel_futures=True)
        self._changed.notify_all()

    def _retire(self, model: _Model, numbers: set[int]) -> None:
        """Stops serving versions (lock held); each closes when its last lease ends."""
        for number in numbers:
            self._retire_entry(model.versions[number])

    def _retire_entry(self, entry: _Version) -> None:
        if entry.state == "AVAILABLE":
            entry.state = "UNLOADING"
            if entry.leases == 0:
                self._close(entry)

    def _close(self, entry: _Version) -> None:
        """Marks a version ended (lock held); its session closes on a thread of its own, so
        that a request's thread or the event loop never waits for it (`stop` joins them)."""
        model, entry.model, entry.state = entry.model, None, "END"
        closing = threading.Thread(target=model.close, name="model-close")
        closing.start()
        self._closing = [thread for thread in self._closing if thread.is_alive()] + [closing]

    def _serving_version(self, name: str, version: int | None,
                         label: str | None) -> tuple[int, _Version]:
        """The version a request names (lock held)."""
        if label is not None:
            version = self._label_version(name, label)
        versions = self._models[name].versions if name in self._models else {}
        available = {v: e for v, e in versions.items() if e.state == "AVAILABLE"}
        if version is None:
            if not available:
                raise ServingError("NOT_FOUND",
                                   f"Servable not found for request: Latest({echo(name)})")
            version = max(available)
        if version not in available:
            raise ServingError("NOT_FOUND",
                               f"Servable not found for request: Specific({echo(name)}, {version})")
        return version, available[version]

    def _label_version(self, name: str, label: str) -> int:
        labels = self._labels.get(name, {}) if name in self._models else {}
        if label not in labels:
            raise ServingError("INVALID_ARGUMENT",
                               f"Unrecognized servable version label: {echo(label)}")
        return labels[label]


def _versions_on_disk(base_path: str) -> list[int]:
    """`list_versions`, but a base path that is not there is an error, not "no versions": as
    in TF Serving, a path transiently missing (a remount, a symlink swap) changes nothing."""
    if not os.path.isdir(base_path):
        raise FileNotFoundError(f"the base path {base_path} is not there")
    return list_versions(base_path)


def _check_unique(configs: list[ModelConfig]) -> None:
    """Refuses a model list naming a model twice, as TF Serving does (INVALID_ARGUMENT)."""
    names = set()
    for config in configs:
        if config.name in names:
            raise ServingError("INVALID_ARGUMENT", f"Illegal to list model {echo(config.name)} "
                               "multiple times in config list")
        names.add(config.name)


def _under(path: str, root: str) -> bool:
    """Whether `path` is `root` or inside it (both resolved)."""
    return os.path.commonpath([path, root]) == root


def _add_status(response: get_model_status_pb2.GetModelStatusResponse, number: int,
                entry: _Version) -> None:
    status = response.model_version_status.add(version=number)
    status.state = get_model_status_pb2.ModelVersionStatus.State.Value(entry.state)
    status.status.SetInParent()          # TF Serving always reports it, OK included
    if entry.error is not None:
        status.status.error_code = error_codes_pb2.Code.Value(entry.error.code)
        status.status.error_message = entry.error.message
