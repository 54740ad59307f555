#!/usr/bin/env bash
# demo-kind.sh (`make demo`): Cairn on a real three-node kind cluster. Brings the cluster
# up (reused if it exists), builds and loads the images, deploys Cairn, has
# a pod write data to a three-replica PVC, fails a replica's node, shows
# the repair live, and verifies the data. Where ../shared/tools/kind-offline
# sits beside the clone (machines without registry access) it builds the
# kind node image and the CSI sidecars first: minutes the first time.
set -euo pipefail
cd "$(dirname "$0")/.."

source hack/kind-up.sh
k() { kubectl --context "kind-$CLUSTER" "$@"; }

say "a PVC (StorageClass cairn: 3 replicas, ext4) and a pod writing 64 MiB with its checksum"
# The app (so the engine) runs where the manager runs, if that is a worker:
# the node failed below is then the other worker, and the manager keeps
# repairing while it is down.
cp_nodes=$(k get nodes -l node-role.kubernetes.io/control-plane -o name | sed 's|node/||')
app_node=$(k -n cairn-system get pod -l app.kubernetes.io/component=manager -o jsonpath='{.items[0].spec.nodeName}')
if grep -qxF "$app_node" <<<"$cp_nodes"; then
  app_node=$(k get nodes -l '!node-role.kubernetes.io/control-plane' -o name | sed 's|node/||' | head -1)
fi
APP_IMAGE=${APP_IMAGE:-kind-offline/e2e-tools:local}
docker image inspect "$APP_IMAGE" >/dev/null 2>&1 || APP_IMAGE=debian:bookworm-slim
k apply -f - <<YAML
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: demo}
spec:
  storageClassName: cairn
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 512Mi}}
---
apiVersion: v1
kind: Pod
metadata: {name: demo}
spec:
  nodeName: $app_node
  containers:
  - name: app
    image: $APP_IMAGE
    imagePullPolicy: IfNotPresent
    command: ["sh", "-c", "cd /data && [ -f sum ] || { dd if=/dev/urandom of=blob bs=1M count=64 status=none && sha256sum blob > sum && sync; }; cat sum; sleep infinity"]
    volumeMounts: [{name: data, mountPath: /data}]
  volumes:
  - {name: data, persistentVolumeClaim: {claimName: demo}}
YAML
k wait pod/demo --for=condition=Ready --timeout=3m
pv=$(k get pvc demo -o jsonpath='{.spec.volumeName}')
until k exec demo -- test -f /data/sum 2>/dev/null; do sleep 1; done
k exec demo -- cat /data/sum
k -n cairn-system get volume "$pv"
k -n cairn-system get replicas -l storage.cairn.io/volume="$pv" -o wide

engine_node=$(k -n cairn-system get volume "$pv" -o jsonpath='{.status.currentNodeName}')
# A worker holding a replica but not the engine (stopping the control
# plane would stop the API server too).
victim=$(k -n cairn-system get replicas -l storage.cairn.io/volume="$pv" -o jsonpath='{range .items[*]}{.spec.nodeName}{"\n"}{end}' |
  grep -vx "$engine_node" | grep -vxF "$cp_nodes" | head -1)
[[ -n $victim ]] || { echo "demo-kind: no worker holds a replica without the engine" >&2; exit 1; }
say "node $victim (a replica, not the engine) fails: docker stop $victim; started again once the volume is degraded"
docker stop "$victim" >/dev/null
show() { k -n cairn-system get volume "$pv" -o jsonpath='{.status.state} {.status.robustness} | {range .status.conditions[?(@.type=="Rebuilding")]}{.message}{end}'; echo; }
# Back at once: a replica failed for longer than the manager's
# --replenishment-wait (60 s) is not given back, and with three nodes its
# replacement has nowhere to go.
for _ in $(seq 24); do
  sleep 5; printf '   '; show
  [[ $(k -n cairn-system get volume "$pv" -o jsonpath='{.status.robustness}') == degraded ]] && break
done
docker start "$victim" >/dev/null
say "node $victim is back: its replica resyncs what it missed"
for _ in $(seq 60); do
  sleep 3; printf '   '; show
  [[ $(k -n cairn-system get volume "$pv" -o jsonpath='{.status.robustness}') == healthy ]] && break
done

say "the data, checked in the pod"
k exec demo -- sh -c 'cd /data && sha256sum -c sum'

say "done"
cat <<TXT
Look around:  kubectl --context kind-$CLUSTER -n cairn-system get volumes,engines,replicas,snapshots -o wide
Clean up:     kubectl --context kind-$CLUSTER delete pod/demo pvc/demo
              kind delete cluster --name $CLUSTER
TXT
