# Sourced by scripts/gpu-check.sh and the GPU bundle's run.sh: make NVRTC and cuBLAS findable by
# the loader when its cache (ldconfig) does not know them, by adding their folders to
# LD_LIBRARY_PATH. Looks in a CUDA toolkit under /usr/local and in every Python site-packages'
# `nvidia/` folder (pip's CUDA 13 wheels put them in nvidia/cu13/lib, the CUDA 12 ones in
# nvidia/cublas/lib and nvidia/cuda_nvrtc/lib); and the driver's libcuda.so.1 in the driver's
# usual folders (/usr/local/nvidia/lib64 on containers and VMs) when the cache lacks it. Prints
# what it added; finds nothing quietly (the programs then say which library they could not load).
cuda_libs_on_path() {
  local candidates=(/usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu
    /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib)
  local d site
  for d in /usr/local/cuda-*/lib64 /usr/local/cuda-*/targets/x86_64-linux/lib; do
    [ -d "$d" ] && candidates+=("$d")
  done
  while IFS= read -r site; do
    [ -d "$site/nvidia" ] || continue
    while IFS= read -r d; do
      candidates+=("$d")
    done < <(find "$site/nvidia" -maxdepth 3 -type d -name lib 2>/dev/null | sort -r)
  done < <(python3 -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path[1:]))' 2>/dev/null | sort -u)
  local lib_dirs=() lib dir
  # The versions the programs are built for (cudarc's CUDA 13 bindings): a registered CUDA 12
  # toolkit must not hide pip's CUDA 13 libraries. NVRTC also needs its builtins library beside
  # it on the path, which its own folder provides.
  for lib in libcuda.so.1 libnvrtc.so.13 libcublas.so.13; do
    if ldconfig -p 2>/dev/null | grep -q -F "$lib "; then
      continue
    fi
    for dir in "${candidates[@]}"; do
      if compgen -G "$dir/$lib*" >/dev/null; then
        case " ${lib_dirs[*]} " in *" $dir "*) ;; *) lib_dirs+=("$dir") ;; esac
        break
      fi
    done
  done
  if [ ${#lib_dirs[@]} -gt 0 ]; then
    local extra
    extra=$(IFS=:; echo "${lib_dirs[*]}")
    export LD_LIBRARY_PATH="$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "LD_LIBRARY_PATH += $extra"
  fi
}
