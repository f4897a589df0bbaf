"""Talking to a Kubernetes cluster: submit, status, logs, cancel, list.

Modules: `kubeconfig` (where and who), `client` (the HTTP boundary, in dicts), `retry`
(what is retried and how long), `errors` (ClusterError subtypes), `submit`, `status`,
`logs`, `cancel`, `listing` (the operations), `preflight` (what submit checks the cluster has first, with
`podsecurity`: the Pod Security level a pod meets), `progress` (rank 0's live progress line, from a bounded
log tail), `watch` (`status -w`), `output` (tables and JSON), `cli` (argparse).
Importing this package imports nothing heavy: the kubernetes client loads on first use.
"""
