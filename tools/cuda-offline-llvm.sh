#!/usr/bin/env bash
# Offline route for `--features cuda` (Burn 0.22.1 / cubecl 0.11.3).
#
# cubecl-cuda always depends on cubecl-llvm, whose build script asks tracel-llvm-bundler for
# an LLVM 23.1 bundle that it downloads from the internet unless
# $XDG_DATA_HOME/tracel/tracel-llvm-23.1.0-4/.tracel-llvm-installed exists. This script
# fills that prefix from Debian's LLVM 22 packages instead (apt only; bookworm ships 22.1.8.
# LLVM 19 compiles but lacks 8 LLVM-C functions pliron-llvm calls, so the final link fails),
# with an `llvm-config` wrapper that fixes one incompatibility: Debian's `--system-libs` lists libz3 by full path,
# which the bundler turns into `-llibz3`.
#
# usage: tools/cuda-offline-llvm.sh        (as root, or with sudo for apt-get)
# then:  cargo build --release -p kiln-cli --features cuda
set -euo pipefail
v="${KILN_LLVM_VERSION:-22}"
llvm=/usr/lib/llvm-$v
if [ ! -x "$llvm/bin/llvm-config" ] || [ ! -f "$llvm/lib/libPolly.a" ]; then
  apt-get update -qq
  apt-get install -y -qq "llvm-$v-dev" "libpolly-$v-dev" libzstd-dev libz3-dev
fi
prefix="${XDG_DATA_HOME:-$HOME/.local/share}/tracel/tracel-llvm-23.1.0-4"
rm -rf "$prefix"
mkdir -p "$prefix/bin"
ln -s "$llvm/include" "$prefix/include"
ln -s "$llvm/lib" "$prefix/lib"
for tool in "$llvm"/bin/*; do
  [ "$(basename "$tool")" = llvm-config ] || ln -s "$tool" "$prefix/bin/"
done
cat >"$prefix/bin/llvm-config" <<WRAP
#!/usr/bin/env bash
# Debian's llvm-config, with full library paths in --system-libs turned into -l flags.
out=\$("$llvm/bin/llvm-config" "\$@") || exit \$?
case " \$* " in
  *" --system-libs "*) printf '%s\n' "\$out" | sed -E 's#(^| )/[^ ]*/lib([^ /]+)\\.(so|a)[^ ]*#\\1-l\\2#g' ;;
  *) printf '%s\n' "\$out" ;;
esac
WRAP
chmod +x "$prefix/bin/llvm-config"
touch "$prefix/.tracel-llvm-installed"
echo "LLVM prefix ready: $prefix (Debian LLVM $("$llvm/bin/llvm-config" --version))"
"$prefix/bin/llvm-config" --system-libs --link-static
