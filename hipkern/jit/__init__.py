"""hipkern's JIT: builds C-ABI kernel modules for the current GPU on first use and caches them."""
from .builder import BuildResult, Module, build, load, module_key
from .modules import ModuleSpec, all_specs, spec
from .platform import JitError, current_arch, platform_of, wave_size_of

__all__ = ["BuildResult", "Module", "ModuleSpec", "JitError", "all_specs", "build", "current_arch", "load",
           "module_key", "platform_of", "spec", "wave_size_of"]
