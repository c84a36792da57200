# sourced by run.sh after install: where the model load segfaults, and which variant loads
diag() {
  cd "$REPO"
  M=models/synthetic.gguf
  echo "== a: llama-cpp-python's own Llama, all layers on CUDA"
  timeout 60 python3 -X faulthandler -c "
import llama_cpp
m = llama_cpp.Llama('$M', n_gpu_layers=-1, verbose=True, n_ctx=256)
print('A-OK', m.tokenize(b'hello'))" 2>&1 | grep -v '^llama_model_loader: - kv\|^load_tensors: \|^print_info' | tail -25
  echo "== b: the engine's Model, llama.cpp's log to stderr (no callback)"
  PGROUPS_LLAMA_LOG=stderr timeout 60 python3 -X faulthandler -c "
from engine.native import Model
m = Model('$M'); print('B-OK', m.n_layer, m.layer_devices)" 2>&1 | tail -12
  echo "== c: the engine's Model with the log callback"
  timeout 60 python3 -X faulthandler -c "
from engine.native import Model
m = Model('$M'); print('C-OK', m.n_layer, m.layer_devices)" 2>&1 | tail -8
  echo "== d: c under cuda-gdb"
  timeout 90 cuda-gdb -q -batch -ex run -ex bt -ex 'info threads' --args python3 -c "
from engine.native import Model
m = Model('$M'); print('D-OK')" 2>&1 | grep -v '^\[New Thread\|^\[Thread .* exited' | tail -45
}
export -f diag
