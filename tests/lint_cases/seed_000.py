# Seed 000, "DDP multi-GPU training, the whole process": the recipe's code, in its order.
import os

import torch

torch.distributed.init_process_group(backend="nccl")

os.environ["CUDA_VISIBLE_DEVICES"] = "0, 1, 2"  # 有几块GPU写多少

parser.add_argument("--local_rank", type=int, default=1, help="number of cpu threads to use during batch generation")

train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)

train_loader = torch.utils.data.DataLoader(
	train_dataset,
	batch_size = args.batch_size,
	shuffle = False,
	num_workers = args.num_workers,
	pin_memory = True,
	sampler = train_sampler)

local_rank = torch.distributed.get_rank()
torch.cuda.set_device(local_rank)
global device
device = torch.device("cuda", local_rank)

model.to(device)  # 这句不能少，最好不要用model.cuda()
model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank, find_unused_parameters=True)  # 这句加载到多GPU上

# python -m torch.distributed.launch --nnodes=1 --nproc_per_node=3 train.py

model_dict = torch.load("0.pth")

def save_checkpoint(epoch, model, best_top5, optimizer,
                        is_best=False,
                        filename='checkpoint.pth.tar'):
    state = {
        'epoch': epoch+1, 'state_dict': model.module.state_dict(),
        'best_top5': best_top5, 'optimizer' : optimizer.state_dict(),
    }
    torch.save(state, filename)

if args.local_rank == 0:
    if is_best: save_checkpoint(epoch, model, best_top5, optimizer, is_best=True, filename='model_best.pth.tar')
