#!/usr/bin/env bash
# A CUDA 12.4 toolkit for the cu124 wheel variant, from Debian trixie's non-free nvidia-cuda-toolkit
# (12.4.131), on any Debian/Ubuntu machine with apt and dpkg, without installing anything: a private apt
# (its own sources, lists and cache under DIR) downloads the pinned .debs, `dpkg -x` unpacks them, and the
# spread Debian layout (/usr/bin, /usr/lib/nvidia-cuda-toolkit, /usr/include, /usr/lib/x86_64-linux-gnu)
# is linked into the layout nvcc and CMake expect (bin/, nvvm/, include/, lib64/) with its own
# nvcc.profile. Prints the toolkit root (use it as CUDA_HOME / MSA_CUDA12_ROOT).
#
#   scripts/cuda12_debian.sh [DIR]     DIR default: ~/.cache/msa-wheels/toolkits (about 1 GB of .debs,
#                                      2.7 GB unpacked; the .debs are deleted after unpacking)
#
# What 12.4 cannot build here (README.md, "Install"): sm_100 / sm_120 (CUDA >= 12.8) and the Hopper kernels
# (90a): csrc/sm90 calls cudaGetDriverEntryPointByVersion, which CUDA 12.5 introduced. The cu124 variant
# therefore builds "80;86;89;90" (portable kernels; H100 runs them, not the wgmma ones).
set -euo pipefail
TOP=${1:-${MSA_CACHE:-$HOME/.cache/msa-wheels}/toolkits}
VER_TK="12.4.131~12.4.1-2"   # nvidia-cuda-toolkit, libnvvm4
VER_DEV="12.4.127~12.4.1-2"  # nvidia-cuda-dev, libcudart12
VER_CCCL="2.3.2-2"           # libcu++-dev, libcub-dev, libthrust-dev (CCCL 2.3.2, as CUDA 12.4 ships)
PKGS=("nvidia-cuda-toolkit=$VER_TK" "libnvvm4=$VER_TK" "nvidia-cuda-dev=$VER_DEV" "libcudart12=$VER_DEV"
      "libcu++-dev=$VER_CCCL" "libcub-dev=$VER_CCCL" "libthrust-dev=$VER_CCCL")
ROOT="$TOP/cu124-debian"
if [ -f "$ROOT/.complete" ]; then echo "$ROOT"; exit 0; fi
log() { echo "cuda12_debian: $*" >&2; }
command -v apt-get >/dev/null && command -v dpkg >/dev/null || { log "needs apt-get and dpkg"; exit 1; }
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
[ -f "$KEYRING" ] || { log "no $KEYRING (package debian-archive-keyring)"; exit 1; }
gpg_ok=0; ls /usr/share/keyrings/debian-archive-trixie-*.gpg >/dev/null 2>&1 && gpg_ok=1
[ $gpg_ok = 1 ] || log "warning: this keyring may predate trixie's keys; apt will refuse unsigned lists"

APTDIR="$TOP/apt-trixie"
mkdir -p "$APTDIR"/{etc/apt/sources.list.d,etc/apt/preferences.d,etc/apt/apt.conf.d,var/lib/apt/lists/partial,var/cache/apt/archives/partial,var/lib/dpkg,debs}
touch "$APTDIR/var/lib/dpkg/status"
echo "deb [signed-by=$KEYRING] http://deb.debian.org/debian trixie main contrib non-free" > "$APTDIR/etc/apt/sources.list"
APT=(apt-get -q -o "Dir=$APTDIR" -o "Dir::State::status=$APTDIR/var/lib/dpkg/status"
     -o "Dir::Etc::SourceList=$APTDIR/etc/apt/sources.list" -o "Dir::Etc::SourceParts=$APTDIR/etc/apt/sources.list.d"
     -o "Dir::Etc::Parts=$APTDIR/etc/apt/apt.conf.d" -o "Dir::Etc::PreferencesParts=$APTDIR/etc/apt/preferences.d"
     -o APT::Architecture=amd64 -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
log "apt update (trixie, private lists in $APTDIR)"
"${APT[@]}" update >&2
# apt checks each .deb against the signed Release file's hashes.
(cd "$APTDIR/debs" && "${APT[@]}" download "${PKGS[@]}" >&2)

X="$TOP/cu124-debian-extract"
rm -rf "$X" "$ROOT"
mkdir -p "$X"
for d in "$APTDIR"/debs/*.deb; do log "unpacking $(basename "$d")"; dpkg -x "$d" "$X"; done
rm -rf "$APTDIR/debs"

mkdir -p "$ROOT/bin" "$ROOT/nvvm/bin" "$ROOT/lib64"
# nvcc reads nvcc.profile next to its own file (symlinks resolved): a copy, with our profile beside it.
cp "$X/usr/lib/nvidia-cuda-toolkit/bin/nvcc" "$ROOT/bin/nvcc"
for b in ptxas fatbinary nvlink cudafe++ bin2c nvprune cuobjdump nvdisasm cu++filt __nvcc_device_query; do
  ln -s "$X/usr/bin/$b" "$ROOT/bin/$b"
done
ln -s "$X/usr/lib/nvidia-cuda-toolkit/bin/crt" "$ROOT/bin/crt"
ln -s "$X/usr/lib/nvidia-cuda-toolkit/bin/cicc" "$ROOT/nvvm/bin/cicc"
ln -s "$X/usr/lib/nvidia-cuda-toolkit/libdevice" "$ROOT/nvvm/libdevice"
ln -s "$X/usr/include" "$ROOT/include"
# CMake's CUDA compiler probe links libcudadevrt.a and libcudart_static.a; torch's runtime brings the shared one.
for l in "$X"/usr/lib/x86_64-linux-gnu/libcudart* "$X/usr/lib/x86_64-linux-gnu/libcudadevrt.a" \
         "$X"/usr/lib/x86_64-linux-gnu/libnvvm.so*; do
  ln -s "$l" "$ROOT/lib64/"
done
[ -d "$X/usr/lib/x86_64-linux-gnu/stubs" ] && ln -s "$X/usr/lib/x86_64-linux-gnu/stubs" "$ROOT/lib64/stubs"
ln -s lib64 "$ROOT/lib"
cat > "$ROOT/bin/nvcc.profile" <<'EOF'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib64:
PATH            += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64/stubs" "-L$(TOP)/lib64"
CUDAFE_FLAGS    +=
PTXAS_FLAGS     +=
EOF
"$ROOT/bin/nvcc" --version | tail -n 2 >&2
printf '%s\n' "${PKGS[@]}" > "$ROOT/.complete"
echo "$ROOT"
