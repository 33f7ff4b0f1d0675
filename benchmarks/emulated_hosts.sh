#!/bin/bash
# Emulated hosts (network namespaces, shaped links) on a many-core host, where each rank has a
# core of its own: the issues' emulated-host rows that a 2-core machine bends (its CPU binds
# first). About 4.5 min on 16 cores. Run from the project root as root: `bash
# benchmarks/emulated_hosts.sh`. Needs `ip` and `tc` (iproute2); on a host without them and
# without a network, bring Debian's packages in .deb/ first (on a Debian machine:
#   mkdir -p .deb && (cd .deb && apt-get download iproute2 libbpf1 libmnl0 libelf1 libcap2 \
#     libxtables12 libbsd0 libmd0 libdb5.3 libselinux1 libtirpc3 libpcre2-8-0 zlib1g libzstd1 \
#     libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1)
# ): they are unpacked under /tmp and run through the loader with their own libraries only.
# Writes $OUT/emulated.txt when $OUT is set.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/aioreduce-emulated}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/emulated.txt") 2>&1
T0=$SECONDS
echo "== env"; nproc; uname -r
python3 -m pip install -q --no-index --no-deps --no-build-isolation . 2>&1 | tail -2
if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "no ip/tc here: Debian's iproute2 from .deb/, run through the loader"
  root=$(pwd); mkdir -p /tmp/ipr /tmp/iprbin
  for f in "$root"/.deb/*.deb; do dpkg-deb -x "$f" /tmp/ipr; done
  libs=/tmp/ipr/lib/x86_64-linux-gnu:/tmp/ipr/usr/lib/x86_64-linux-gnu
  for t in ip tc; do  # (sbin/ip is a link to /bin/ip: the file itself)
    bin=$(find /tmp/ipr -path "*bin/$t" -type f | head -1)
    printf '#!/bin/sh\nexec /lib64/ld-linux-x86-64.so.2 --library-path %s %s "$@"\n' \
      "$libs" "$bin" > /tmp/iprbin/$t
    chmod +x /tmp/iprbin/$t
  done
  export PATH=/tmp/iprbin:$PATH
fi
python3 -c "from aioreduce.bench import cluster; print('cluster:', cluster.available() or 'ok')"
t() { local s=$SECONDS; timeout "$@"; echo "rc=$? $((SECONDS-s))s (at $((SECONDS-T0))s)"; }
B="aioreduce-bench allreduce"
echo "== 13 hosts, 200 us, 40 KB: coded tree against ring (issue 34)"
t 60 $B --scheme coded-tree,ring --nodes 13 --size 40K --netns --link-mbit 1000 --latency 0.0002 \
  --iters 60 --warmup 10
echo "== tail with background flows, 4 hosts and 2 flows, 8 hosts and 4 flows (issue 35)"
for hf in 4:2 8:4; do
  t 110 $B --scheme transpose,ring --vs-gloo --nodes ${hf%:*} --netns --link-mbit 1000 \
    --background ${hf#*:} --size 1M --options '{"max_loss": 1}' --gc-every 50 --iters 100
done
echo "== 13 hosts at 1 Gbit/s, 16 MiB: each scheme against its own bound (issue 34)"
t 120 $B --scheme ring,tree,coded-tree,star,gc,transpose --nodes 13 --size 16M --netns \
  --link-mbit 1000 --bound --iters 8 --warmup 2
echo "== done $((SECONDS-T0))s"
