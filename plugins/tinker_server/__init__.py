"""A Tinker-protocol server: the official ``tinker`` SDK talks to it as it talks to Tinker, and
models train and sample behind it on the local backend.

It is not a backend -- it *uses* one -- so it lives apart from
:mod:`tempering.plugins.backends.tinker` (the client of Tinker's service): the client imports
nothing of this package, and this package imports nothing of the client. The tests run the
Tinker backend against it; it is also the start of a product of its own (serving Tinker's API
on one's own hardware).

* :mod:`~tempering.plugins.tinker_server.server`: the HTTP endpoints, fault injection, the
  request log, ``python -m tempering.plugins.tinker_server``;
* :mod:`~tempering.plugins.tinker_server.service`: training runs and samplers on
  :class:`~tempering.plugins.backends.local.backend.LocalBackend`;
* :mod:`~tempering.plugins.tinker_server.wire`: the SDK's protobuf messages;
* :mod:`~tempering.plugins.tinker_server.builtin_losses`: Tinker's built-in losses as documented.

Importing this package imports neither torch nor the SDK; its modules do.
"""
