"""Kernel providers for the hy3 ops (see `hy3c.kernels.registry`)."""

from hy3c.kernels.registry import Provider, provider_by_target, providers_for, register_provider

__all__ = ["Provider", "provider_by_target", "providers_for", "register_provider"]
