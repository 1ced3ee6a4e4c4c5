# Seed 002, "PyTorch DDP on one machine with several GPUs": its two demos and the key repair.
import os
from collections import OrderedDict

import torch
from torch.utils.data import DataLoader

def one_gpu():  # 单机单卡
    os.environ["CUDA_VISIBLE_DEVICES"] = '7'
    device = torch.device('cuda:0' if torch.cuda.is_available() else 'cpu')
    model = Unet_3D(1, 1).to(device)
    data = data.to(device)
    criterion = DiceLoss().to(device)
    torch.save(model.state_dict(), save_path)

def several_gpus():  # 单机多卡
    devices = [5,6,7] # 这个是要训练的卡，nvidia-smi显示出的肉眼可见的卡
    os.environ["CUDA_VISIBLE_DEVICES"] = ','.join([str(i) for i in devices])
    device_ids = [i for i in range(len(devices))]
    model = Unet_3D(1, 1)
    model = torch.nn.DataParallel(model, device_ids=device_ids)
    model = model.cuda(device_ids[0])
    data = data.cuda(device=device_ids[0])
    criterion = DiceLoss().cuda(device=device_ids[0])
    torch.save(model.module.state_dict(), save_path)

def load_network(model_path):

    # Model was saved by mutiple GPUs training but tested by single GPU

    model = Unet_3D(1, 1).to(device)
    state_dict = torch.load(model_path, map_location='cuda:0')

    new_state_dict = OrderedDict()

    for k, v in state_dict.items():
        namekey = k[7:] # remove `module.`
        new_state_dict[namekey] = v

    model.load_state_dict(new_state_dict)

    return model

train_load = DataLoader(dataset=train_set, batch_size=args.batch_size*len(args.device_ids), shuffle=True, num_workers=8)
