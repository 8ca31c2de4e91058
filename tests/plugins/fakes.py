"""Fake plugins used by the plugin tests: good, broken and clashing ones."""

from __future__ import annotations

from execrt.core.interfaces import AttentionCapabilities, MoEDispatcherCapabilities
from execrt.core.plugins import hookimpl

NATIVE = "execrt.backends.attention.torch_native:TorchNativeAttnBackend"


class GoodPlugin:
    @hookimpl
    def execrt_register_backends(self, registry):
        registry.register("attention", "fake_attn", NATIVE, AttentionCapabilities(), priority=5)


class ClashingPlugin:
    @hookimpl
    def execrt_register_backends(self, registry):
        registry.register("attention", "fake_attn", NATIVE, AttentionCapabilities())


class BuiltinClashPlugin:
    """Registers a new name, then one the built-in plugin already has: refused whole."""

    @hookimpl
    def execrt_register_backends(self, registry):
        registry.register("attention", "newcomer_extra", NATIVE, AttentionCapabilities())
        registry.register("attention", "torch_native", NATIVE, AttentionCapabilities())


class SwallowingClashPlugin:
    """Catches the refusal of a built-in's name and carries on: still refused whole."""

    @hookimpl
    def execrt_register_backends(self, registry):
        registry.register("attention", "swallow_extra", NATIVE, AttentionCapabilities())
        try:
            registry.register("moe_dispatch", "allreduce", NATIVE, MoEDispatcherCapabilities())
        except Exception:
            pass
        registry.register("attention", "swallow_late", NATIVE, AttentionCapabilities())


def _explode(init):
    raise RuntimeError("cuda context lost")


class BrokenFactoryPlugin:
    """Two high-priority CPU backends: one whose module does not import, one whose
    constructor raises. ``auto`` must skip both, with the reasons, and build torch_native."""

    @hookimpl
    def execrt_register_backends(self, registry):
        registry.register(
            "attention",
            "unimportable",
            "tests.plugins.no_such_module:Backend",
            AttentionCapabilities(),
            priority=500,
        )
        registry.register("attention", "explodes", _explode, AttentionCapabilities(), priority=400)


class RaisingPlugin:
    @hookimpl
    def execrt_register_backends(self, registry):
        registry.register("attention", "half_done", NATIVE, AttentionCapabilities())
        raise RuntimeError("kernel library exploded")


class TwiceSelfPlugin:
    @hookimpl
    def execrt_register_backends(self, registry):
        registry.register("attention", "twice", NATIVE, AttentionCapabilities())
        registry.register("attention", "twice", NATIVE, AttentionCapabilities())


class UnmarkedPlugin:
    """Its hook lacks @hookimpl: pluggy never calls it."""

    def execrt_register_backends(self, registry):
        registry.register("attention", "unmarked", NATIVE, AttentionCapabilities())


class WrongCapabilitiesPlugin:
    @hookimpl
    def execrt_register_backends(self, registry):
        registry.register("attention", "confused", NATIVE, MoEDispatcherCapabilities())


class UnknownHookPlugin:
    @hookimpl
    def execrt_register_everything(self, registry):  # not a hookspec
        pass


class NoArgsPlugin:
    @hookimpl
    def execrt_register_backends(self):  # may take a subset of the hook's arguments
        NoArgsPlugin.called = True


class GpuOnlyPlugin:
    @hookimpl
    def execrt_register_backends(self, registry):
        registry.register(
            "attention",
            "gpu_only",
            NATIVE,
            AttentionCapabilities(devices=frozenset({"cuda"})),
            requires=("surely_not_installed_kernel_lib",),
            install_hint="pip install gpu-only",
            priority=100,
        )


# Entry-point targets: a module-level object pluggy can register.
good = GoodPlugin()


class IntFactoryPlugin:
    @hookimpl
    def execrt_register_backends(self, registry):
        registry.register("attention", "int_factory", 42, AttentionCapabilities())


class WordPriorityPlugin:
    @hookimpl
    def execrt_register_backends(self, registry):
        registry.register(
            "attention", "word_priority", NATIVE, AttentionCapabilities(), priority="high"
        )


class StringHeadDimsPlugin:
    @hookimpl
    def execrt_register_backends(self, registry):
        caps = AttentionCapabilities(head_dims={"64"}, devices="cuda")
        registry.register("attention", "string_dims", NATIVE, caps)


def _raising_check(req):
    raise RuntimeError("nvml not found")


class RaisingCheckPlugin:
    """A CPU backend first for auto whose environment probe raises: refused, never a crash."""

    @hookimpl
    def execrt_register_backends(self, registry):
        registry.register(
            "attention",
            "raising_check",
            NATIVE,
            AttentionCapabilities(),
            priority=900,
            check=_raising_check,
        )


def _not_a_backend(init):
    return {"i am": "a dict"}


class NotABackendPlugin:
    """First for auto on CPU, and its factory builds a dict: auto must fall through."""

    @hookimpl
    def execrt_register_backends(self, registry):
        registry.register(
            "attention", "not_a_backend", _not_a_backend, AttentionCapabilities(), priority=800
        )
        registry.register(
            "attention", "wrong_class", "json:JSONDecoder", AttentionCapabilities(), priority=700
        )


# Entry-point targets of the bad-registration tests.
int_factory = IntFactoryPlugin()
word_priority = WordPriorityPlugin()
string_dims = StringHeadDimsPlugin()
raising_check = RaisingCheckPlugin()
not_a_backend = NotABackendPlugin()
