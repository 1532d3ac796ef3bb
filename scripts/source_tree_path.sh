# Sourced by the GPU scripts: make `import dspark` work from this source tree without
# installing the kit (a GPU host may have torch and transformers but no way to install
# it). pyproject maps dspark.training, dspark.engine, ... to top-level folders,
# so the same layout is made with links inside dspark/ (ignored by git).
dspark_source_tree_path() {
  local root=$1 py=${2:-python3}
  if (cd /tmp && "$py" -c "import dspark.training, dspark.engine, dspark.plugins" 2>/dev/null); then
    return 0  # installed (pip install -e .)
  fi
  local d
  for d in training engine plugins configs; do
    [ -e "$root/dspark/$d" ] || ln -s "../$d" "$root/dspark/$d"
  done
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
}
