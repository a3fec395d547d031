"""fastroute as the endpoint picker (EPP) of an Envoy-based gateway, over Envoy's ext_proc.

``fastroute epp`` runs the same registry, target table, ledger and routing groups as the proxy,
but relays no bytes: Envoy asks over ``envoy.service.ext_proc.v3.ExternalProcessor/Process``
which worker each request goes to, and fastroute answers with the worker's ``ip:port`` in the
``x-gateway-destination-endpoint`` header (and in the ``envoy.lb`` dynamic metadata), books the
lease at the pick and releases it when the response ends or the stream dies.

Modules: :mod:`~fastroute.epp.options` (the command line, refusals), :mod:`~fastroute.epp.bootstrap`
(the Envoy bootstrap it prints), :mod:`~fastroute.epp.decide` (the pick and the lease of one
stream, no gRPC), :mod:`~fastroute.epp.service` (the ext_proc servicer),
:mod:`~fastroute.epp.server` (the process), :mod:`~fastroute.epp.pool` (InferencePool
discovery), :mod:`~fastroute.epp.sidecar` (``fastroute sidecar``, the PD relay of a decode
pod). gRPC and the Envoy protos (``pip install fastroute[epp]``) are imported only by the
service and the server.
"""
