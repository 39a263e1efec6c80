"""The pytest plugin of benchmarks/peers.py: copied by it into a temporary
directory, loaded there with `-p`, and removed when the run ends."""

import ipaddress
import json
import os
import socket
import sys


_RESULTS = os.environ["FILTERJIT_PEERS_RESULTS"]
_PATCH = os.environ["FILTERJIT_PEERS_PATCH"] == "1"
_TARGET = os.environ["FILTERJIT_PEERS_TARGET"]  # "equinox" or "jax.jit"


def _record(**entry):
    with open(_RESULTS, "a", encoding="utf-8") as file:
        file.write(json.dumps(entry) + "\n")


def _name(jit):
    return f"{jit.__module__}.{jit.__qualname__}"


# No network: connections go to this machine or nowhere.
def _is_local(address):
    if not isinstance(address, tuple):
        return True  # AF_UNIX paths, and the like
    host = address[0]
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def _refuse(address):
    raise OSError(f"benchmarks/peers.py: no network in this run ({address!r})")


_connect = socket.socket.connect
_connect_ex = socket.socket.connect_ex
_getaddrinfo = socket.getaddrinfo


def _guarded_connect(self, address):
    if not _is_local(address):
        _refuse(address)
    return _connect(self, address)


def _guarded_connect_ex(self, address):
    if not _is_local(address):
        _refuse(address)
    return _connect_ex(self, address)


def _guarded_getaddrinfo(host, *args, **kwargs):
    if host is not None and not _is_local(
        (host if isinstance(host, str) else host.decode(),)
    ):
        _refuse(host)
    return _getaddrinfo(host, *args, **kwargs)


socket.socket.connect = _guarded_connect
socket.socket.connect_ex = _guarded_connect_ex
socket.getaddrinfo = _guarded_getaddrinfo


# After the hooks of the plugins registered later (pluggy calls them first):
# jaxtyping's, which installs its import hook and refuses packages already
# imported. Before pytest's own (trylast), which loads the initial conftest.py
# files.
def pytest_load_initial_conftests(early_config, parser, args):
    if _TARGET != "equinox":
        _install_jit()
        return
    preimported = sorted(
        name
        for name in ("equinox", "lineax", "optimistix", "diffrax")
        if name in sys.modules
    )
    import equinox

    swapped = left = None
    _count_equinox_wrappers()
    if _PATCH:
        import filterjit

        _count_filterjit_wrappers(filterjit)
        if hasattr(filterjit, "patch_equinox"):
            patch = filterjit.patch_equinox()
            swapped, left = list(patch.swapped), list(patch.left)
        else:  # `--rev` of a filterjit from before patch_equinox
            equinox.filter_jit = filterjit.filter_jit
    _record(
        event="start",
        patched=_PATCH,
        filter_jit=_name(equinox.filter_jit),
        preimported=preimported,
        swapped=swapped,
        left=left,
    )


# How many jit wrappers each library made during the run: Equinox's counted where
# its `filter_jit` finishes one (`module_update_wrapper`, a global of
# `equinox._jit` that only `filter_jit` calls), filterjit's where one is
# initialised. In the patched run, Equinox's are the ones left unswapped: made by
# code that bound Equinox's `filter_jit` before the patch.
_MADE = {"equinox": 0, "filterjit": 0}
_UNCOUNTED = set()


def _count_equinox_wrappers():
    import equinox._jit

    finish = getattr(equinox._jit, "module_update_wrapper", None)
    if finish is None:  # an Equinox without it: no count
        _UNCOUNTED.add("equinox")
        return

    def counted(wrapper, *args, **kwargs):
        _MADE["equinox"] += 1
        return finish(wrapper, *args, **kwargs)

    setattr(equinox._jit, "module_update_wrapper", counted)


def _count_filterjit_wrappers(filterjit):
    cls = type(filterjit.filter_jit(_count_filterjit_wrappers))
    init = cls.__init__

    def counted(self, *args, **kwargs):
        _MADE["filterjit"] += 1
        init(self, *args, **kwargs)

    cls.__init__ = counted


def _message(report):
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


# Each executable XLA compiles for the CPU holds about ten memory maps until JAX's
# caches let go of it. A suite that compiles thousands of programs in one process
# reaches the kernel's limit (vm.max_map_count, often 65530), and XLA crashes in
# the next compile. Between tests, past half the limit, clear JAX's caches: both
# runs alike, and only where the run would otherwise crash.
def _map_limit():
    if os.environ.get("FILTERJIT_PEERS_CLEAR") != "1":
        return None
    if os.environ.get("FILTERJIT_PEERS_MAP_LIMIT"):  # to test this
        return int(os.environ["FILTERJIT_PEERS_MAP_LIMIT"])
    try:
        with open("/proc/sys/vm/max_map_count") as file:
            return int(file.read()) // 2
    except (OSError, ValueError):
        return None


_MAP_LIMIT = _map_limit()


def _maps():
    with open("/proc/self/maps", "rb") as file:
        return sum(1 for _ in file)


def _clear_if_needed():
    if _MAP_LIMIT is None or _maps() <= _MAP_LIMIT:
        return
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    _record(event="clear", limit=_MAP_LIMIT, maps=_maps())


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        _clear_if_needed()
    entry = {
        "event": "test",
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "duration": report.duration,
    }
    if hasattr(report, "wasxfail"):
        entry["xfail"] = True
    if report.failed:
        entry["message"] = _message(report)
    _record(**entry)


# For JAX's own tests: `jax.jit` (and `jax._src.api.jit`, which tests call as
# `api.jit`) becomes a function that looks at its caller. Called from a file of the
# suite (a test module, a function or decorator defined there, however spelled:
# `jit`, `jax.jit`, `api.jit`, `partial(jax.jit, ...)`, a parameterized value), it
# makes `filterjit.jit` in the patched run and `jax.jit` in the other; called from
# anywhere else (JAX itself, filterjit), always `jax.jit`. Installed before the
# suite's conftest.py files and test modules are imported, so that
# `from jax import jit` binds it too. JAX's own modules bound `jit` when they were
# imported, before this, and never see it.
_SUITE = os.path.realpath(os.environ.get("FILTERJIT_PEERS_SUITE", os.getcwd()))
_SWAPS = {"swapped": 0, "internal": {}}
_JIT = {}  # the name of what the suite's jit calls make


def _install_jit():
    import functools

    import jax
    import jax._src.api

    original = jax.jit
    replacement = original
    if _PATCH:
        import filterjit

        replacement = filterjit.jit

    @functools.wraps(original)
    def jit(*args, **kwargs):
        caller = sys._getframe(1).f_globals
        path = caller.get("__file__") or ""
        if os.path.realpath(path).startswith(_SUITE + os.sep):
            _SWAPS["swapped"] += 1
            return replacement(*args, **kwargs)
        module = caller.get("__name__", "?")
        _SWAPS["internal"][module] = _SWAPS["internal"].get(module, 0) + 1
        return original(*args, **kwargs)

    jax.jit = jax._src.api.jit = jit
    _JIT["name"] = _name(replacement)
    _record(event="start", patched=_PATCH, filter_jit=_JIT["name"], preimported=[])


def pytest_collection_modifyitems(session, config, items):
    # After a crash, the run resumes past the tests already begun.
    try:
        with open(os.environ["FILTERJIT_PEERS_DONE"], encoding="utf-8") as file:
            done = set(file.read().splitlines())
    except (KeyError, OSError):
        return
    deselected = [item for item in items if item.nodeid in done]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.nodeid not in done]


def pytest_collectreport(report):
    if report.failed:
        _record(event="collect", nodeid=report.nodeid, message=_message(report))


# Which jit the libraries' module-level entry points ended up with.
_WRAPPERS = {"_JitWrapper": "equinox", "FilterJitWrapper": "filterjit"}


def _wrapped_entry_points():
    counts, seen = {}, set()
    for name, module in list(sys.modules.items()):
        library = name.partition(".")[0]
        if library not in ("equinox", "lineax", "optimistix", "diffrax"):
            continue
        for value in list(getattr(module, "__dict__", {}).values()):
            kind = _WRAPPERS.get(type(value).__name__)
            if kind is not None and id(value) not in seen:
                seen.add(id(value))
                by_kind = counts.setdefault(library, {})
                by_kind[kind] = by_kind.get(kind, 0) + 1
    return counts


def pytest_sessionfinish(session, exitstatus):
    if _TARGET == "jax.jit":
        _record(
            event="end",
            exitstatus=int(exitstatus),
            filter_jit=_JIT.get("name", "?"),
            swaps=_SWAPS,
        )
        return
    import equinox

    _record(
        event="end",
        exitstatus=int(exitstatus),
        filter_jit=_name(equinox.filter_jit),
        entry_points=_wrapped_entry_points(),
        made={
            library: None if library in _UNCOUNTED else n
            for library, n in _MADE.items()
        },
    )
