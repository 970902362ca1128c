"""Every place on a node where kvcached state or engine leftovers can live, pods included (kvctl -A).

- `discover`: the places, from one /proc pass: the host's /dev/shm and /tmp,
  each other filesystem some process sees at /dev/shm or /tmp in its own mount
  namespace, the kubelet's memory-backed emptyDir volumes, the container
  runtimes' per-sandbox shm mounts; one place per device; named as well as the
  node shows without the API server (pod UID, pod, namespace, container).
- `evidence`: who can have made or be using a file in a place: the processes
  that see its filesystem, by their PIDs in their own namespaces; held and
  mapped by identity across the node.
- `run`: a plan per place from the same facts, and the guarded act inside
  each place alone (docs/PLACES.md).
"""
