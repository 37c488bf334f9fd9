"""PyTorch's (oneDNN's) training convolutions on W5's shapes, per layer: forward, input
gradient and weight gradient, median ms of 5 runs, and the W5 total weighted by how often each
shape occurs. The side-by-side partner of `cargo bench -p kiln --bench train_conv -- 2`
(same shapes, same order, batch 64).

    $PEERS_VENV/bin/python bench/torch_train_conv.py [threads]      # default 2
"""
import sys
import torch, time
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
cases = [("stem 3→64 32²", 3, 32, 64, 3, 1, 1, 1),("3x3 64 32²", 64, 32, 64, 3, 1, 1, 4),("3x3/2 64→128", 64, 32, 128, 3, 2, 1, 1),("1x1/2 64→128", 64, 32, 128, 1, 2, 0, 1),("3x3 128 16²", 128, 16, 128, 3, 1, 1, 3),("3x3/2 128→256", 128, 16, 256, 3, 2, 1, 1),("1x1/2 128→256", 128, 16, 256, 1, 2, 0, 1),("3x3 256 8²", 256, 8, 256, 3, 1, 1, 3),("3x3/2 256→512", 256, 8, 512, 3, 2, 1, 1),("1x1/2 256→512", 256, 8, 512, 1, 2, 0, 1),("3x3 512 4²", 512, 4, 512, 3, 1, 1, 3)]
def t(f, n=5):
    f(); f()
    ts=[]
    for _ in range(n):
        a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
    ts.sort(); return ts[len(ts)//2]*1e3
tot=[0,0,0]
for name,cin,side,cout,k,s,p,cnt in cases:
    x=torch.randn(64,cin,side,side); w=torch.randn(cout,cin,k,k)
    y=torch.nn.functional.conv2d(x,w,stride=s,padding=p); g=torch.randn_like(y)
    fw=t(lambda: torch.nn.functional.conv2d(x,w,stride=s,padding=p))
    dx=t(lambda: torch.ops.aten.convolution_backward(g,x,w,None,[s,s],[p,p],[1,1],False,[0,0],1,[True,False,False]))
    dw=t(lambda: torch.ops.aten.convolution_backward(g,x,w,None,[s,s],[p,p],[1,1],False,[0,0],1,[False,True,False]))
    print(f"{name:<16} {fw:9.2f} {dx:9.2f} {dw:9.2f}")
    for i,v in enumerate((fw,dx,dw)): tot[i]+=v*cnt
print("W5 weighted", [round(v,1) for v in tot], round(sum(tot),1))
